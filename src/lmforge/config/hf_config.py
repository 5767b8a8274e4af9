"""Mapping between the architecture configs and the Hugging Face `config.json` of a Llama, Qwen3, GLM-4.5 MoE, Qwen3-MoE
or gpt-oss model.

`arch_to_hf_config` writes the keys `transformers` itself saves for `LlamaConfig` / `Qwen3Config` / `Glm4MoeConfig` /
`Qwen3MoeConfig` / `GptOssConfig`, with the RoPE base (and GLM's partial rotary factor, and any RoPE scaling) both in
`rope_parameters` (read by transformers 5) and at the top level (`rope_theta`, `rope_scaling`: read by transformers 4).
`read_hf_config` accepts only what the lmforge decoder computes exactly: MLPs without bias, SiLU-gated (for Llama and
Qwen3 also ReLU-squared-gated, `hidden_act = "relu2"`), RoPE plain or scaled
(`linear`, `llama3`, `yarn`; partial for GLM-4.5), full or sliding-window attention per layer, and, for Qwen3-MoE, an
MoE block in every layer; gpt-oss's weights unquantized (not MXFP4). Anything else fails with the file and field at
fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from lmforge.config.arch import (
    AnyArch,
    DeepseekV3Arch,
    DenseArch,
    Glm4MoeArch,
    GptOssArch,
    LlamaArch,
    Qwen3Arch,
    Qwen3MoeArch,
)
from lmforge.config.arch_base import MlpAct
from lmforge.config.rope import rope_fields_of

CONFIG_NAME = "config.json"
"""File name of the model config inside an HF model folder."""

GENERATION_CONFIG_NAME = "generation_config.json"
"""File name of the generation defaults inside an HF model folder."""

RESEARCH_MODEL_TYPE = "lmforge_moe"
"""The `model_type` of an exported GLM-4.5 family model with research options on (`Glm4MoeArch.research_options`):
lmforge's own, which transformers does not know and cannot load; `lmforge sample`, `model.name` and `lmforge
export` read it back exactly."""

RESEARCH_KEYS = ("attn_output_gate", "xsa", "null_experts", "router_bias_on_logits", "moe_latent_size", "expert_glu",
                 "situ_beta", "situ_linear_beta", "hyper_connections", "hyper_connections_dynamic")  # fmt: skip
"""The research option fields, written to (and read from) a `lmforge_moe` config.json under their own names."""

_CLASS_NAMES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    RESEARCH_MODEL_TYPE: "LmforgeMoeForCausalLM",
}
_ARCH_CLASSES: dict[str, type[AnyArch]] = {
    "llama": LlamaArch,
    "qwen3": Qwen3Arch,
    "glm4_moe": Glm4MoeArch,
    "qwen3_moe": Qwen3MoeArch,
    "gpt_oss": GptOssArch,
    "deepseek_v3": DeepseekV3Arch,
    RESEARCH_MODEL_TYPE: Glm4MoeArch,
}
_GLM_TYPES = ("glm4_moe", RESEARCH_MODEL_TYPE)
_EXPORT_DTYPES = ("bfloat16", "float32")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# What an HF config means when it leaves a field out: the defaults of transformers' config classes, which differ
# from the lmforge defaults (an absent rms_norm_eps is 1e-6 for an HF Llama, an absent head_dim 128 for Qwen3).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": None},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128},
    "glm4_moe": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "head_dim": None},
    "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": None},
    "gpt_oss": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "head_dim": 64},
    # config.json's head_dim is the RoPE part (transformers derives it); lmforge's MLA widths are the fields below
    "deepseek_v3": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
}
_HF_DEFAULTS[RESEARCH_MODEL_TYPE] = _HF_DEFAULTS["glm4_moe"]

# The MoE fields of each family with transformers' defaults (taken when config.json leaves one out).
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": {
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": False,
    },
    "qwen3_moe": {
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "deepseek_v3": {
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_interleave": True,
    },
    "gpt_oss": {
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    },
}
_MOE_DEFAULTS[RESEARCH_MODEL_TYPE] = _MOE_DEFAULTS["glm4_moe"]
_GLM_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig default
# transformers' GptOssConfig scaling when config.json has neither rope_parameters nor rope_scaling.
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}  # fmt: skip
_ATTENTION_BIAS_DEFAULT = {"gpt_oss": True}
"""attention_bias of an HF config that leaves it out, where transformers' default is not false."""
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class HFModelError(ValueError):
    """An HF model folder that lmforge cannot read or load; the message names the file (and field) at fault."""


@dataclass(frozen=True)
class HFModelInfo:
    """What an HF `config.json` says about the model: its architecture, vocabulary and special tokens."""

    arch: AnyArch
    """The architecture, with every default of the HF config class made explicit."""
    vocab_size: int
    """Rows of the embedding matrix."""
    bos_id: int | None
    """Beginning-of-sequence token id, if the config names one."""
    eos_id: int | None
    """End-of-sequence token id (the first one when the config lists several)."""
    pad_id: int | None
    """Padding token id, if the config names one."""
    torch_dtype: str | None
    """The dtype the weights were saved in (`dtype`, or the older `torch_dtype`), if the config says."""


def arch_to_hf_config(
    arch: AnyArch,
    vocab_size: int,
    *,
    bos_id: int | None,
    eos_id: int | None,
    pad_id: int | None,
    dtype: str,
    init_std: float = 0.02,
) -> dict[str, Any]:
    """The complete `config.json` of `arch` as a `LlamaForCausalLM`, `Qwen3ForCausalLM`, `Glm4MoeForCausalLM`,
    `Qwen3MoeForCausalLM` or `GptOssForCausalLM`, keys sorted."""
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_EXPORT_DTYPES)}; got {dtype!r}")
    research = isinstance(arch, Glm4MoeArch) and bool(arch.research_options)
    model_type = RESEARCH_MODEL_TYPE if research else arch.model_type
    config: dict[str, Any] = {
        "architectures": [_CLASS_NAMES[model_type]],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.kv_heads,
        "head_dim": arch.dim_per_head,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_parameters": _rope_parameters(arch),
        # transformers 4 reads only the top-level key and would silently fall back to its default base.
        "rope_theta": arch.rope_theta,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": arch.mlp_act,
        "initializer_range": init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": dtype,
    }
    if arch.rope_scaling is not None:
        config["rope_scaling"] = arch.rope_scaling.hf_parameters()  # transformers 4's key for the scaling
    elif isinstance(arch, GptOssArch):
        config["rope_scaling"] = None  # transformers 4's GptOssConfig would otherwise default to YaRN
    config.update(_family_keys(arch))
    if research:
        config.update({key: getattr(arch, key) for key in RESEARCH_KEYS})
    return dict(sorted(config.items()))


def _family_keys(arch: AnyArch) -> dict[str, Any]:
    """The config.json keys of one family beyond those every family shares."""
    if isinstance(arch, LlamaArch):
        return {"mlp_bias": False, "pretraining_tp": 1}
    if isinstance(arch, Qwen3Arch):
        # transformers sets sliding_window to None without use_sliding_window, and saves it so.
        return {"mlp_bias": False, "use_sliding_window": arch.use_sliding_window,
                "sliding_window": arch.sliding_window if arch.use_sliding_window else None,
                "max_window_layers": arch.max_window_layers, "layer_types": arch.block_attention}  # fmt: skip
    if isinstance(arch, GptOssArch):
        return {"num_local_experts": arch.num_local_experts, "num_experts_per_tok": arch.num_experts_per_tok,
                "sliding_window": arch.sliding_window, "layer_types": arch.block_attention,
                "swiglu_alpha": arch.swiglu_alpha, "swiglu_limit": arch.swiglu_limit, "router_aux_loss_coef": 0.001,
                "output_router_logits": False}  # fmt: skip
    moe = {"moe_intermediate_size": arch.moe_intermediate_size, "num_experts_per_tok": arch.num_experts_per_tok,
           "norm_topk_prob": arch.norm_topk_prob, "output_router_logits": False}  # fmt: skip
    if isinstance(arch, DeepseekV3Arch):
        mla = {key: getattr(arch, key) for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                   "qk_rope_head_dim", "v_head_dim", "rope_interleave")}  # fmt: skip
        experts = {key: getattr(arch, key) for key in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace",
                                                       "routed_scaling_factor", "n_group", "topk_group")}  # fmt: skip
        # transformers derives head_dim (the RoPE part) and saves it.
        return {**moe, **mla, **experts, "head_dim": arch.qk_rope_head_dim, "qk_head_dim": arch.dim_per_head,
                "num_nextn_predict_layers": arch.num_nextn_predict_layers, "pretraining_tp": 1}  # fmt: skip
    if isinstance(arch, Qwen3MoeArch):
        # `num_experts` is the name Qwen's checkpoints and transformers 4 use; transformers 5 maps it.
        return {**moe, "num_experts": arch.num_experts, "decoder_sparse_step": arch.decoder_sparse_step,
                "mlp_only_layers": list(arch.mlp_only_layers), "router_aux_loss_coef": 0.001,
                "use_sliding_window": arch.use_sliding_window,
                "sliding_window": arch.sliding_window if arch.use_sliding_window else None}  # fmt: skip
    return {
        **moe,
        "n_routed_experts": arch.n_routed_experts,
        "n_shared_experts": arch.n_shared_experts,
        "first_k_dense_replace": arch.first_k_dense_replace,
        "routed_scaling_factor": arch.routed_scaling_factor,
        "n_group": arch.n_group,
        "topk_group": arch.topk_group,
        "use_qk_norm": arch.use_qk_norm,
        "rope_parameters": {**_rope_parameters(arch), "partial_rotary_factor": arch.partial_rotary_factor},
        "partial_rotary_factor": arch.partial_rotary_factor,
        # lmforge trains no multi-token-prediction layers; the default (1) would announce weights that are absent.
        "num_nextn_predict_layers": 0,
    }


def _rope_parameters(arch: AnyArch) -> dict[str, Any]:
    """transformers 5's `rope_parameters`: the base with the scaling's keys (`rope_type` 'default' without)."""
    scaling = arch.rope_scaling.hf_parameters() if arch.rope_scaling is not None else {"rope_type": "default"}
    return {"rope_theta": arch.rope_theta, **scaling}


def generation_config(bos_id: int | None, eos_id: int | None, pad_id: int | None) -> dict[str, Any]:
    """The `generation_config.json` of an exported model: its special token ids (unset ones left out)."""
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    return {key: value for key, value in ids.items() if value is not None}


def read_hf_config(folder: Path) -> HFModelInfo:
    """Read `folder/config.json` of a Llama, Qwen3, GLM-4.5 MoE, Qwen3-MoE or gpt-oss model into an architecture
    lmforge can build exactly."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFModelError(f"{folder}: no such model folder")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise HFModelError(f"{path}: not found; an HF model folder needs a {CONFIG_NAME}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFModelError(f"{path}: cannot be read as JSON: {err}") from err
    if not isinstance(raw, dict):
        raise HFModelError(f"{path}: must hold a JSON object, got {type(raw).__name__}")

    model_type = raw.get("model_type")
    if model_type not in _ARCH_CLASSES:
        raise HFModelError(
            f"{path}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(_ARCH_CLASSES))}"
        )
    missing = [key for key in _REQUIRED if raw.get(key) is None]
    if missing:
        raise HFModelError(f"{path}: required field(s) missing: {', '.join(missing)}")
    _check_supported(raw, path)

    defaults = _HF_DEFAULTS[model_type]
    fields: dict[str, Any] = {key: raw[key] for key in _REQUIRED if key != "vocab_size"}
    for key, default in defaults.items():
        fields[key] = raw[key] if raw.get(key) is not None else default
    fields["rope_theta"] = _rope_theta(raw, defaults["rope_theta"])
    rope_raw = raw
    if model_type == "gpt_oss" and raw.get("rope_scaling") is None and raw.get("rope_parameters") is None:
        rope_raw = {**raw, "rope_scaling": _GPT_OSS_ROPE}
    fields["rope_scaling"] = _rope_scaling(rope_raw, fields["max_position_embeddings"])
    fields["num_key_value_heads"] = raw.get("num_key_value_heads")
    fields["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
    fields["attention_bias"] = raw.get("attention_bias", _ATTENTION_BIAS_DEFAULT.get(model_type, False))
    fields.update(_moe_fields(raw, model_type))
    if issubclass(_ARCH_CLASSES[model_type], DenseArch):
        fields["hidden_act"] = raw.get("hidden_act", "silu")
    if model_type == "deepseek_v3":
        fields["num_nextn_predict_layers"] = _mtp_layers_stored(folder, raw)
    try:
        arch = _ARCH_CLASSES[model_type](**fields)
    except ValidationError as err:
        raise HFModelError(f"{path}: not a valid {model_type} architecture:\n{err}") from err

    vocab_size = raw["vocab_size"]
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise HFModelError(f"{path}: vocab_size must be a positive integer, got {vocab_size!r}")
    dtype = raw.get("dtype") or raw.get("torch_dtype")
    return HFModelInfo(
        arch=arch,
        vocab_size=vocab_size,
        bos_id=_token_id(raw, "bos_token_id", path),
        eos_id=_token_id(raw, "eos_token_id", path),
        pad_id=_token_id(raw, "pad_token_id", path),
        torch_dtype=str(dtype) if dtype is not None else None,
    )


def _mtp_layers_stored(folder: Path, raw: dict[str, Any]) -> int:
    """How many of config.json's `num_nextn_predict_layers` MTP modules the folder's weights hold (decoder layers
    num_hidden_layers.. with an `eh_proj`): DeepSeek's releases store them, transformers' own saves drop them, and
    a model built with modules that have no weights could not load. Reads the safetensors index or header only; a
    folder without safetensors weights (a run's checkpoint, whose weights are elsewhere) takes config.json's count."""
    wanted = raw.get("num_nextn_predict_layers") or 0
    if not wanted:
        return 0
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    names: set[str] = set()
    try:
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                names = set(f.keys())
        elif index.is_file():
            names = set(json.loads(index.read_text()).get("weight_map", {}))
        else:
            return int(wanted)
    except (OSError, ValueError) as err:
        raise HFModelError(f"{folder}: cannot list the checkpoint's tensors: {err}") from err
    layers = raw["num_hidden_layers"]
    stored = 0
    while stored < wanted and f"model.layers.{layers + stored}.eh_proj.weight" in names:
        stored += 1
    return stored


def _moe_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of an HF config (transformers' defaults for absent ones); none for a dense family."""
    fields = {key: raw[key] if raw.get(key) is not None else default
              for key, default in _MOE_DEFAULTS.get(model_type, {}).items()}  # fmt: skip
    if model_type == "qwen3_moe" and raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
        fields["num_experts"] = raw["num_local_experts"]  # transformers 5 saves the attribute-mapped name
    if model_type == "deepseek_v3":
        # null is meaningful here (no low-rank query path): only an absent key takes transformers' default
        fields["q_lora_rank"] = raw.get("q_lora_rank", 1536)
    if model_type == "gpt_oss":
        if raw.get("num_local_experts") is None and raw.get("num_experts") is not None:
            fields["num_local_experts"] = raw["num_experts"]
        if raw.get("layer_types") is not None:
            fields["layer_types"] = tuple(raw["layer_types"])
    if model_type == RESEARCH_MODEL_TYPE:
        fields.update({key: raw[key] for key in RESEARCH_KEYS if raw.get(key) is not None})
    if model_type in ("qwen3", "qwen3_moe"):
        fields.update(_window_fields(raw, model_type))
    if model_type in _GLM_TYPES:
        rope = raw.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        fields["partial_rotary_factor"] = _GLM_PARTIAL_ROTARY if factor is None else factor
    return fields


def _window_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The sliding-window fields of a Qwen3 / Qwen3-MoE config (transformers' defaults for absent ones). Without
    use_sliding_window the others change nothing (every block attends fully) and are left at their defaults."""
    if not raw.get("use_sliding_window"):
        return {"use_sliding_window": False}
    fields: dict[str, Any] = {"use_sliding_window": True}
    if raw.get("sliding_window") is not None:
        fields["sliding_window"] = raw["sliding_window"]
    if model_type == "qwen3":
        if raw.get("max_window_layers") is not None:
            fields["max_window_layers"] = raw["max_window_layers"]
        if raw.get("layer_types") is not None:
            fields["layer_types"] = tuple(raw["layer_types"])
    return fields


def _check_supported(raw: dict[str, Any], path: Path) -> None:
    """Reject the features the lmforge decoder does not compute, naming the field."""
    glm = raw["model_type"] in _GLM_TYPES
    act = raw.get("hidden_act", "silu")
    dense = issubclass(_ARCH_CLASSES[raw["model_type"]], DenseArch)
    acts: tuple[str, ...] = get_args(MlpAct) if dense else ("silu",)
    if act not in acts:
        raise HFModelError(
            f"{path}: hidden_act {act!r} is not supported for model_type {raw['model_type']!r}; lmforge's MLPs "
            f"compute {' or '.join(repr(a) for a in acts)}"
        )
    if raw.get("mlp_bias"):
        raise HFModelError(f"{path}: mlp_bias true is not supported; lmforge MLPs have no bias")
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise HFModelError(f"{path}: {key} must be an object or null, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise HFModelError(
                f"{path}: {key} with rope_type {rope_type!r} is not supported; lmforge computes "
                f"{', '.join(repr(kind) for kind in _ROPE_TYPES)}"
            )
        # An entry the kind does not read would change the frequencies in a way lmforge does not compute; nested
        # per-layer dicts are not one RoPE. GLM-4.5 rotates part of each head, other families all of it.
        extra = sorted(set(rope) - {"rope_type", "type", "rope_theta"} - rope_fields_of(rope_type))
        partial_ok = glm or rope.get("partial_rotary_factor") == 1.0
        if extra and not (extra == ["partial_rotary_factor"] and partial_ok):
            raise HFModelError(f"{path}: {key} field(s) {', '.join(extra)} are not supported for rope_type "
                               f"{rope_type!r}")  # fmt: skip
    if not glm and raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFModelError(f"{path}: partial_rotary_factor {raw['partial_rotary_factor']!r} is not supported")
    if raw.get("quantization_config") is not None:
        quant = raw["quantization_config"]
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise HFModelError(
            f"{path}: quantization_config ({method or 'unknown method'}) is not supported; lmforge loads unquantized "
            "weights: save a dequantized copy first (for gpt-oss's MXFP4 weights, transformers' "
            "Mxfp4Config(dequantize=True))"
        )
    windows = raw.get("layer_types") or ["sliding_attention"]  # transformers' default alternates
    if raw["model_type"] == "gpt_oss" and "sliding_attention" in windows and not raw.get("sliding_window", 128):
        raise HFModelError(f"{path}: layer_types has sliding_attention layers but sliding_window is "
                           f"{raw.get('sliding_window')!r}")  # fmt: skip
    if raw["model_type"] in ("qwen3", "qwen3_moe", "gpt_oss"):
        if raw.get("use_sliding_window") and not raw.get("sliding_window"):
            window = raw.get("sliding_window")
            raise HFModelError(f"{path}: use_sliding_window is true but sliding_window is {window!r}")
        layer_types = raw.get("layer_types") or []
        odd = [i for i, kind in enumerate(layer_types) if kind not in ("full_attention", "sliding_attention")]
        if odd:
            raise HFModelError(
                f"{path}: layer_types {layer_types[odd[0]]!r} at layer {odd[0]} is not supported; lmforge has "
                f"full_attention and sliding_attention"
            )
        windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        if windowed and not raw.get("use_sliding_window") and raw["model_type"] != "gpt_oss":
            # transformers gives such blocks no window; lmforge will not guess what was meant.
            raise HFModelError(
                f"{path}: layer_types marks layer {windowed[0]} sliding_attention but use_sliding_window is false"
            )


def _rope_scaling(raw: dict[str, Any], max_positions: int) -> dict[str, Any] | None:
    """The RoPE scaling of an HF config as transformers 5 reads it: `rope_scaling` before `rope_parameters`, the
    pretraining length from a top-level `original_max_position_embeddings`, else the scaling's own, else
    `max_position_embeddings`; a YaRN factor left out is the ratio of the two lengths. None for plain RoPE."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    fields = {key: rope[key] for key in rope_fields_of(rope_type) if rope.get(key) is not None}
    if rope_type != "linear":
        original = raw.get("original_max_position_embeddings") or fields.get("original_max_position_embeddings")
        fields["original_max_position_embeddings"] = original or max_positions
    if rope_type == "yarn" and "factor" not in fields:
        fields["factor"] = max_positions / fields["original_max_position_embeddings"]
    return {"rope_type": rope_type, **fields}


def _rope_theta(raw: dict[str, Any], default: float) -> Any:
    """The RoPE base: `rope_parameters.rope_theta` (transformers 5) before the top-level key (transformers 4)."""
    params = raw.get("rope_parameters") or {}
    if params.get("rope_theta") is not None:
        return params["rope_theta"]
    if raw.get("rope_theta") is not None:
        return raw["rope_theta"]
    return default


def _token_id(raw: dict[str, Any], key: str, path: Path) -> int | None:
    """A token id field; HF configs may list several end tokens, of which the first is the primary one."""
    value = raw.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HFModelError(f"{path}: {key} must be a non-negative integer, a list of them or null; got {value!r}")
    return value
