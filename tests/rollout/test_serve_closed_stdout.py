"""Issue 49 M3: ``tppo serve | head -1`` then SIGTERM: the server stops and exits, its port
free again, although its stdout is closed (the print of "stopping" used to raise
BrokenPipeError before ``server.stop()``, leaving the process up and holding the port)."""

import os
import signal
import socket
import subprocess
import sys


def test_sigterm_stops_serve_with_a_closed_stdout(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tppo_jax.cli", "serve", "--port", "0",
                             "--no-http", "--slots", "1"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("READY "), ready
        port = int(ready.split(" on ")[1].split()[0].rsplit(":", 1)[1])
        proc.stdout.close()  # what `| head -1` does once it has its line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", port))


def test_a_signal_before_or_during_the_wait_stops_it():
    """The stop signal is not lost when it lands before ``wait()`` (right after READY), and
    the handler takes no lock the waiting thread may hold."""
    import threading

    from tppo_jax.cli.serve import StopSignals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait() == signal.SIGTERM
    with StopSignals() as stop:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        assert stop.wait() == signal.SIGINT
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
