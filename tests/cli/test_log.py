import io
import logging
import sys

from tppo_jax.cli.log import log_to_stderr


def test_the_root_handler_follows_sys_stderr_after_the_stream_it_was_made_with_closes(
        monkeypatch):
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log_to_stderr(logging.WARNING, ours=logging.INFO)
    logging.getLogger("tppo_jax.test").info("one")
    first.close()  # a notebook cell's or a test's capture, gone
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("tppo_jax.test").info("two")
    logging.getLogger("other").info("hidden")
    assert second.getvalue() == "INFO tppo_jax.test: two\n"
