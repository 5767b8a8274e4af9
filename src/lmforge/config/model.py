"""`[model]`: architecture, init, attention backend, precision and the parallelism knobs of the model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config.arch import ArchConfig
from lmforge.config.base import Section
from lmforge.config.rope import RopeScaling


class InitConfig(Section):
    """`[model.init]`: how a from-scratch model is initialized."""

    std: float = Field(default=0.02, gt=0)
    """Standard deviation of the normal init of every weight matrix and embedding."""

    seed: int = 0
    """Seed of the init; values depend only on it, the parameter names and row blocks, not on the world size."""

    truncate: bool = False
    """Draw from the normal truncated at 3 standard deviations (redrawn tails) instead of the plain normal."""

    scheme: Literal["normal", "completep"] = "normal"
    """`normal`: every matrix from N(0, std). `completep`: CompleteP (alpha = 1) relative to the base shape below:
    init, learning rate, weight decay and Adam eps scaled per parameter role (see docs/model.md#completep)."""

    base_hidden_size: int | None = Field(default=None, gt=0)
    """CompleteP base width: the hidden_size the hyperparameters were tuned at (width multiplier = hidden_size /
    base_hidden_size). Required with scheme = "completep"."""

    base_num_layers: int | None = Field(default=None, gt=0)
    """CompleteP base depth: the num_hidden_layers the hyperparameters were tuned at (depth multiplier =
    num_hidden_layers / base_num_layers). Required with scheme = "completep"."""

    zero_out_proj: bool = False
    """Start the last matrix of every residual branch at zero: attention's `o_proj`, the dense MLP's and the MoE
    shared experts' `down_proj`, the routed experts' `down_proj` (LatentMoE: `latent_up_proj` instead), so that every
    block starts as the identity map (Fixup's zero-init of the last layer of each residual branch, Zhang et al.,
    arXiv 1901.09321; Goyal et al., arXiv 1706.02677, zero the last norm scale of each branch). Every other parameter
    gets the values it gets without it. From-scratch init only: a model loaded from `model.name` keeps its weights."""

    @model_validator(mode="after")
    def _base_shape(self) -> InitConfig:
        if self.scheme == "completep" and (self.base_hidden_size is None or self.base_num_layers is None):
            raise ValueError("scheme = 'completep' needs base_hidden_size and base_num_layers")
        return self


class DebugConfig(Section):
    """`[model.debug]`: switches for smoke runs."""

    random_init: bool = False
    """With model.name: take only the architecture from the folder and initialize the weights from scratch
    (`[model.init]`) instead of loading them; a quick way to smoke-test an SFT config."""


class ACConfig(Section):
    """`[model.ac]`: activation checkpointing of decoder blocks."""

    mode: Literal["none", "full", "selective"] = "none"
    """`none` keeps all activations; `full` recomputes a checkpointed block's forward during backward;
    `selective` keeps the outputs of the matmuls and attention and recomputes only the cheap elementwise ops
    (norms, activations, rotary, residual adds)."""

    freq: int = Field(default=1, ge=1)
    """Checkpoint every freq-th block (1 = every block)."""


class MoEBalanceConfig(Section):
    """`[model.moe_balance]`: auxiliary-loss-free load balancing of MoE routers that have a selection bias."""

    coeff: float = Field(default=1e-3, ge=0)
    """Once per optimizer step, each MoE block's selection bias moves by coeff x sign(mean load - expert load),
    from the step's token counts over all ranks (DeepSeek-V3's rule, `rule = "sign"`); 0 turns balancing off (for
    either rule). The GLM-4.5 arch field `load_balance_coeff`, when set, takes precedence. Routers without a
    selection bias (qwen3_moe) are not balanced."""

    rule: Literal["sign", "quantile"] = "sign"
    """How the selection bias moves once per step. `sign`: by coeff towards the under-loaded experts (DeepSeek-V3).
    `quantile`: towards the value that gives every choice the same expected load, read from a histogram of each
    choice's selection values (scores, or logits with the arch's `router_bias_on_logits`) over the step's tokens on
    all ranks: bias_e = mean(q) - q_e, q_e the (1 - k / choices) quantile of choice e's values, approached at
    `quantile_rate` (coeff only switches it on; see docs/model.md)."""

    freeze_at: float | None = Field(default=None, gt=0, le=1)
    """Stop updating the bias after this fraction of max_steps (e.g. 0.9); unset: update until the end. The
    quantile rule also stops recording its histograms then."""

    quantile_bins: int = Field(default=256, ge=8)
    """Histogram bins per choice and block of the quantile rule. A block's first range is [0, 1] for scores and
    [-1, 1] for logits; each step's next one spans twice the previous step's occupied bins (grown by its span on a
    side whose edge bin was hit). The ranges are kept in checkpoints, so a resumed run bins alike."""

    quantile_rate: float = Field(default=0.5, gt=0, le=1)
    """Share of the way the quantile rule moves the bias towards its balancing value each step (1: all of it)."""

    seq_aux_coeff: float = Field(default=0.0, ge=0)
    """Weight of DeepSeek-V3's complementary sequence-wise balance loss, added to the training objective as
    seq_aux_coeff x its mean over the step's segments (every MoE family); 0 leaves it out."""


class ModelConfig(Section):
    """`[model]`: what is trained and how it is laid out on the devices."""

    name: str | None = None
    """A local Hugging Face model folder (config.json + safetensors) to start from: the architecture is read from
    its config.json, its weights are loaded instead of a random init, and its tokenizer files serve when
    tokenizer.name is unset (docs/export.md). Unset: train from scratch."""

    arch: ArchConfig | None = None
    """The architecture: `model_type` plus its fields (see docs/model.md). Required unless `name` is set, which
    fills it in from the folder's config.json."""

    mtp_weight: float = Field(default=0.3, ge=0)
    """Weight lambda of the multi-token-prediction loss, for an architecture with MTP modules
    (`num_nextn_predict_layers` D > 0): the objective adds lambda / D x the sum over depths of each depth's mean
    loss (DeepSeek-V3: 0.3, later 0.1); 0 leaves the modules untrained. Logged as `loss/mtp/<k>`."""

    z_loss: float = Field(default=0.0, ge=0)
    """Coefficient of the auxiliary z-loss (PaLM, arXiv:2204.02311): the objective adds z_loss x the mean over the
    loss tokens of log(Z)^2, Z the softmax normalizer of the token's logits, which keeps the logits from drifting
    (PaLM: 1e-4). `loss/mean` stays the pure cross-entropy; the mean log(Z)^2 is logged as `loss/z`. 0: off.
    Not yet under pipeline parallelism (docs/training.md#auxiliary-z-loss-modelz_loss)."""

    rope_scaling: RopeScaling | None = None
    """With `name`: extend the pretrained model's context by this RoPE scaling (docs/model.md#rope-scaling). It
    replaces the folder's scaling, and max_position_embeddings becomes the folder's x `factor`; the weights are
    loaded unchanged. Unset: the folder's architecture as it is."""

    init: InitConfig = InitConfig()
    """From-scratch initialization (docs/model.md#from-scratch-init-modelinit)."""

    attn: Literal["auto", "flash", "varlen", "flex", "sdpa", "sdpa_loop"] = "auto"
    """Document-masked attention backend; `auto` picks the fastest one that can train on the device
    (docs/model.md#attention-backends-modelattn)."""

    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of parameters in forward/backward (master weights, optimizer state and gradient reduction stay fp32);
    `auto` is bfloat16 on CUDA and float32 on CPU."""

    loss_chunk_tokens: int | Literal["auto"] = "auto"
    """Compute the LM head and cross-entropy this many tokens at a time, the gradient with the loss, never holding
    the full [tokens, vocab] logits (same loss and gradients, a fraction of the memory); 0 computes all logits at once;
    `auto` is 512 on the CPU and 0 on CUDA."""

    compile: bool = False
    """Compile each decoder block with torch.compile."""

    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 training of the decoder blocks' linear layers through torchao (docs/model.md#fp8-training-modelfp8):
    `tensorwise` (one scale per tensor, float8 all-gather under FSDP) or `rowwise` (one scale per row). The
    LM head, embeddings, MoE routers and experts, and layers whose dims are not multiples of 16 stay in
    param_dtype. Needs a CUDA GPU of compute capability >= 8.9, or fp8_emulate."""

    fp8_emulate: bool = False
    """Run model.fp8's casts and scales with high-precision matmuls instead of FP8 kernels: FP8's rounding on any
    device (tests, CPU runs), not its speed."""

    ac: ACConfig = ACConfig()
    """Activation checkpointing."""

    moe_balance: MoEBalanceConfig = MoEBalanceConfig()
    """Load balancing of MoE routers, ignored by dense models
    (docs/model.md#load-balancing-without-an-auxiliary-loss-modelmoe_balance)."""

    debug: DebugConfig = DebugConfig()
    """Switches for smoke runs."""

    defer_grad_sync: bool = False
    """Reduce-scatter gradients once per optimizer step instead of after every micro-batch: less communication,
    but unsharded gradients stay in memory across the micro-batches of a step."""

    @field_validator("loss_chunk_tokens")
    @classmethod
    def _chunk_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 'auto' or a token count >= 0 (0: all logits at once)")
        return value
