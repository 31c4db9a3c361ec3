"""`tppo plan`: per-chip memory arithmetic against hand numbers, and the paper config."""

from __future__ import annotations

import pytest

from tppo_jax import cli
from tppo_jax.cli import launch as launch_cli
from tppo_jax.config import ConfigError, from_dict, load_config
from tppo_jax.launch import GIB
from tppo_jax.plan import ARCHITECTURES, Arch, plan_memory, resolve_arch

PAPER = "configs/paper_qwen25_32b.yaml"


def test_paper_config_loads_with_paper_values():
    c = load_config(PAPER)
    r, a, o = c.rollout, c.algo, c.optim
    assert (c.model.source, c.model.dtype) == ("hf", "bfloat16")
    assert (r.max_response_len, r.window, r.prompts_per_step, r.group_size) == (
        24576, 8192, 512, 16)
    assert r.max_prompt_len + r.max_response_len <= c.model.max_seq_len == 32768
    assert (o.policy_lr, o.value_lr, o.warmup_steps > 0) == (1e-6, 2e-6, True)
    assert r.slots // o.minibatches == 512  # mini-batch 512
    assert (a.gamma, a.eps_low, a.eps_high, a.critic_warmup_steps) == (1.0, 0.2, 0.28, 50)
    assert (c.mesh.data * c.mesh.fsdp * c.mesh.tensor) == 256  # v5p-512


@pytest.mark.parametrize("name,n", [
    ("llama-3-8b", 8_030_261_248),    # HF safetensors totals
    ("qwen2.5-7b", 7_615_616_512),
    ("qwen2.5-32b", 32_763_876_352),
    ("qwen2.5-0.5b", 494_032_768),
])
def test_known_param_counts(name, n):
    assert ARCHITECTURES[name].n_params == n


def tiny_case():
    cfg = from_dict({
        "model": {"dtype": "bfloat16", "max_seq_len": 16},
        "rollout": {"prompts_per_step": 4, "group_size": 2, "max_prompt_len": 8,
                    "max_response_len": 8, "window": 8, "page_size": 4},
        "optim": {"minibatches": 2},
        "mesh": {"data": 1, "fsdp": 2, "tensor": 2},
    })
    arch = Arch("hand", vocab_size=64, hidden_size=8, intermediate_size=16, num_layers=2,
                num_heads=2, num_kv_heads=1, head_dim=4, qkv_bias=False, tie_embeddings=False)
    return cfg, arch


def test_tiny_case_matches_hand_arithmetic():
    cfg, arch = tiny_case()
    p = plan_memory(cfg, "v4-8", arch)  # 4 chips: fsdp=2 x tensor=2
    # Local elements per chip (embed/8 over fsdp -> 4; heads 2 / mlp 16 / vocab 64 over
    # tensor -> 1 / 8 / 32; kv_heads=1 does not divide tensor=2 -> kept whole; norms whole):
    #   per layer: norms 8+8, q 4*1*4, k 4*1*4, v 16, o 1*4*4, gate/up 4*8 each, down 8*4
    per_layer = 8 + 8 + 16 + 16 + 16 + 16 + 32 + 32 + 32
    policy = 2 * per_layer + 32 * 4 + 8 + 4 * 32  # layers, embed, final norm, lm head = 616
    value = policy - 4 * 32  # no LM head
    rows = p["rows"]
    assert rows["policy params"] == policy * 2 == 1232  # bf16
    assert rows["policy grads"] == 1232
    assert rows["policy optimizer"] == policy * 12  # m, v, master in fp32
    # critic: bf16 backbone + fp32 head (8 / fsdp 2 = 4) and bias (1)
    assert rows["value params"] == value * 2 + 5 * 4 == 996
    assert rows["value optimizer"] == value * 12 + 5 * 8
    # mini-batch 8 slots / 2 = 4 sequences of 16 tokens over data*fsdp = 2 -> 32 tokens/chip
    assert p["tokens_per_chip"] == 32
    assert rows["activations (remat boundaries)"] == 32 * 8 * 2 * 2  # tokens*H*bytes*layers
    # working set: 2 (values + cotangents) * tokens * (4H + (2*1 + 2*1)*D + 3*I/2) * bytes
    assert rows["activations (one layer working set)"] == 2 * 32 * (32 + 16 + 24) * 2
    # KV: 8 slots * 16 tokens, per token layers*2*kv_heads*D*bytes = 32 B, slots over dp=2
    assert rows["KV pages"] == (8 * 16 // 2) * 32 == 2048
    assert p["total_bytes"] == 30032 == sum(rows.values())
    assert p["fits"] and p["hbm_bytes"] == 32 * GIB


def test_num_pages_replaces_full_reservation():
    cfg, arch = tiny_case()
    cfg = from_dict({**cfg.to_dict(), "rollout": {**cfg.to_dict()["rollout"], "num_pages": 10}})
    assert plan_memory(cfg, "v4-8", arch)["rows"]["KV pages"] == (10 * 4 // 2) * 32


def test_paper_scale_v5p_512():
    assert plan_memory(load_config(PAPER), "v5p-512")["fits"]  # its paged pool, as shipped
    cfg = load_config(PAPER, ["rollout.num_pages=0"])  # every slot reserved at full length
    p = plan_memory(cfg, "v5p-512")  # arch from model.path (".../Qwen2.5-32B")
    a = ARCHITECTURES["qwen2.5-32b"]
    rows = p["rows"]
    assert p["arch"]["name"] == "qwen2.5-32b" and p["chips"] == 256 and p["hosts"] == 64
    assert p["mesh"] == {"data": 1, "fsdp": 256, "tensor": 1} and p["param_shards"] == 256
    # bf16 params: 2 * n_params / shards, except norms and (tensor=1) q/k/v biases, which the
    # rules do not split over fsdp: those stay whole on every chip.
    whole = a.num_layers * (2 * 5120 + 5120 + 2 * 1024) + 5120
    assert rows["policy params"] == 2 * ((a.n_params - whole) // 256 + whole)
    assert rows["policy params"] == pytest.approx(2 * a.n_params / 256, rel=1e-2)
    # 512 sequences x 26624 tokens over 256 chips, saved at 64 layer boundaries
    assert p["tokens_per_chip"] == 2 * 26624
    assert rows["activations (remat boundaries)"] == 2 * 26624 * 5120 * 2 * 64
    # KV reserved at full length: 8192 slots x 26624 tokens x 256 KiB / 256 chips = 208 GiB
    assert rows["KV pages"] == 8192 * 26624 * (64 * 2 * 8 * 128 * 2) // 256 == 208 * GIB
    assert not p["fits"] and p["total_bytes"] > 95 * GIB
    assert p["total_bytes"] - rows["KV pages"] < 95 * GIB  # everything else does fit
    # ... and the suggested page budget makes it fit
    fitted = load_config(PAPER, [f"rollout.num_pages={p['max_num_pages']}"])
    q = plan_memory(fitted, "v5p-512")
    assert q["fits"] and q["headroom_bytes"] < 0.01 * GIB


def test_plan_cli_prints_table(capsys):
    launch_cli.register(cli.register)
    assert cli.main(["plan", PAPER, "rollout.num_pages=0", "--topology", "v5p-512",
                     "--arch", "Qwen2.5-32B"]) == 0
    out = capsys.readouterr().out
    for needle in ["v5p-512", "256 chips", "policy optimizer", "KV pages", "DOES NOT FIT",
                   "rollout.num_pages <="]:
        assert needle in out


def test_plan_errors(capsys):
    launch_cli.register(cli.register)
    assert cli.main(["plan", PAPER, "--topology", "v5p-64"]) == 2  # mesh is for 256 chips
    assert "mesh" in capsys.readouterr().err
    assert cli.main(["plan", PAPER, "--topology", "v9-8"]) == 2
    assert "invalid TPU type" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="pass --arch"):
        resolve_arch(load_config(PAPER, ["model.path=gs://b/my-model"]))
    with pytest.raises(ConfigError, match="unknown --arch"):
        resolve_arch(load_config(PAPER), "gpt-5")


def test_tiny_default_config_plans_on_cpu_sized_slice():
    p = plan_memory(load_config("default"), "v4-8")
    assert p["arch"]["name"] == "tiny" and p["fits"]


def test_lora_counts_optimizer_and_grads_for_adapters_only():
    cfg, arch = tiny_case()
    lora = from_dict({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "lora_rank": 2,
                                                 "lora_targets": "q,down"}})
    p = plan_memory(lora, "v4-8", arch)  # fsdp=2 x tensor=2, as tiny_case
    # Local fp32 adapter elements per layer: q A [8, 2] (embed/2) 8, B [2, 2, 4] (heads/2) 8;
    # down A [16, 2] (mlp/2) 16, B [2, 8] (embed/2) 8 -> 40; two layers -> 80 (320 bytes)
    rows = p["rows"]
    assert rows["policy params"] == 1232 + 320  # the bf16 base (as without LoRA) + adapters
    assert rows["policy grads"] == 320 and rows["policy optimizer"] == 80 * 8  # m, v fp32
    # the critic shares the policy's frozen base: its own params are adapters + fp32 head (5)
    assert rows["value params"] == 320 + 5 * 4 and rows["value grads"] == 340
    assert rows["value optimizer"] == (80 + 5) * 8
    assert p["lora"] == {"rank": 2, "targets": ["q", "down"], "adapter_params": 2 * (32 + 48),
                         "value_lora": True, "shared_base": True}
    full_critic = from_dict({**lora.to_dict(), "model": {**lora.to_dict()["model"],
                                                         "value_lora": False}})
    q = plan_memory(full_critic, "v4-8", arch)
    # value_lora false: the critic trains in full, as without LoRA (488 bf16 + 5 fp32 elements)
    assert q["rows"]["value params"] == 996 and q["rows"]["value optimizer"] == 488 * 12 + 5 * 8
    assert q["rows"]["policy optimizer"] == 640 and not q["lora"]["shared_base"]


def test_lora_fits_qwen25_15b_on_one_16_gib_chip():
    cfg = "configs/qwen25_15b_gsm8k.yaml"
    full = plan_memory(load_config(cfg), "v5litepod-1", "qwen2.5-1.5b")
    lora = plan_memory(load_config(cfg, ["model.lora_rank=16"]), "v5litepod-1", "qwen2.5-1.5b")
    assert not full["fits"] and full["total_bytes"] > 50 * GIB  # AdamW of two 1.5B models
    assert lora["fits"] and lora["total_bytes"] < 13 * GIB  # 12.2 GiB: see docs/models.md
    rows = lora["rows"]
    assert rows["policy optimizer"] < 0.2 * GIB and rows["value params"] < 0.1 * GIB
    assert lora["lora"]["adapter_params"] == 18_464_768  # rank 16 on all 7 projections


def test_an_instruct_hub_id_names_its_base_architecture():
    """The shipped configs name Hub ids of instruct tunes; ``tppo plan`` needs no --arch."""
    cfg = load_config("configs/qwen25_15b_gsm8k.yaml", ["model.lora_rank=16"])
    assert plan_memory(cfg, "v5litepod-1") == plan_memory(cfg, "v5litepod-1", "qwen2.5-1.5b")
