"""The shape of a decoder-only transformer, as the cost model needs it (pure Python, no torch).

`ModelSpec` lists every linear layer with its shape (`linear_shapes()`), so that the bytes of a
model in a format are ``sum(count * fmt.nbytes((out, in)))`` with the same `Format` the quantiser
uses.  Parameter counts are exact: they equal the number of values in the published checkpoints
(linear layers, biases, norms, embeddings; a tied LM head is counted once).

`ModelSpec.from_hf_config(path)` reads a Hugging Face ``config.json`` of the families in
`FAMILIES`; what differs between families (biases, extra norms, fused projections, defaults that
serialised configs omit) is data in that table, not code.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

#: largest size a config field may give (layers, widths, vocabulary): 2^31 - 1
MAX_SIZE = 2**31 - 1
#: largest config.json read (a real one is a few kB)
MAX_CONFIG_BYTES = 16 << 20


def read_json_file(p: Path, what: str, error: type[Exception]) -> Any:
    """The JSON value in file `p`, or `error` with one line naming `p` and what is wrong with it (a folder,
    too large, not UTF-8, too deeply nested, not JSON, unreadable); `what` names the expected file."""
    try:
        if p.is_dir():
            raise error(f"{p} is a folder, not a {what} file")
        if p.is_file() and p.stat().st_size > MAX_CONFIG_BYTES:
            raise error(f"{p} is {p.stat().st_size:,} bytes, too large for a {what}")
        return json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"no {what} at {p}") from None
    except UnicodeDecodeError as e:
        raise error(f"{p} is not UTF-8 text (byte {e.start}); a {what} is JSON") from None
    except RecursionError:
        raise error(f"{p} is nested too deeply to be a {what}") from None
    except ValueError as e:  # json.JSONDecodeError, or an integer too long to convert
        if isinstance(e, error):
            raise
        raise error(f"{p} is not valid JSON: {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise error(f"{p} cannot be read: {e.strerror or e}") from None


class ModelSpecError(ValueError):
    """A model shape or a config.json that cannot be read."""


@dataclass(frozen=True)
class LinearShape:
    """`count` linear layers of weight shape (out_features, in_features).

    role: "attention", "mlp", "expert", "router" or "lm_head".  A tied LM head shares its weight with
    the embedding: it is read at every step but stored (and counted in `n_params`) once.
    """

    name: str
    out_features: int
    in_features: int
    count: int
    role: str
    tied: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def n_params(self) -> int:
        return self.out_features * self.in_features * self.count


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.  MoE models set `n_experts` and `experts_per_token` (else 0);
    expert_intermediate_size: an expert's width where it differs from the dense MLP's (Qwen-MoE's
    moe_intermediate_size; 0: intermediate_size); shared_expert_size: the width of an always-active shared
    expert beside the routed ones (Qwen2-MoE; 0: none), with its one-row sigmoid gate; moe_layers: how
    many layers hold experts (0: all of them; the rest have a dense MLP, as Qwen-MoE's mlp_only_layers).

    norms_per_layer: RMSNorm/LayerNorm weight vectors of size hidden per layer (2 for Llama, 4 for
    Gemma-2/3); qk_norm: a head_dim-sized norm on queries and one on keys (Qwen3, Gemma-3).
    fused_qkv / fused_gate_up: one projection instead of three / two (Phi-3); the count is unchanged.
    """

    name: str
    family: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    n_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_size: int = 0
    moe_layers: int = 0
    qkv_bias: bool = False
    mlp_bias: bool = False
    o_bias: bool = False
    norms_per_layer: int = 2
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        for f in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_SIZE:
                raise ModelSpecError(f"model {self.name!r}: {f} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ModelSpecError(
                f"model {self.name!r}: {self.n_heads} heads do not split into {self.n_kv_heads} KV heads")
        for f in ("expert_intermediate_size", "shared_expert_size", "moe_layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_SIZE:
                raise ModelSpecError(f"model {self.name!r}: {f} must be an integer >= 0, got {v!r}")
        if self.moe_layers > self.n_layers:
            raise ModelSpecError(f"model {self.name!r}: moe_layers {self.moe_layers} > {self.n_layers} layers")
        if (self.n_experts > 0) != (self.experts_per_token > 0) or self.experts_per_token > self.n_experts:
            raise ModelSpecError(
                f"model {self.name!r}: experts_per_token {self.experts_per_token} with {self.n_experts} experts")

    # ------------------------------------------------------------------ shapes
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def n_moe_layers(self) -> int:
        """Layers that hold experts (0 for a dense model)."""
        return (self.moe_layers or self.n_layers) if self.is_moe else 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def linear_shapes(self) -> list[LinearShape]:
        """Every linear layer of the model, the LM head included (shape = (out, in) of its weight)."""
        L, d, i = self.n_layers, self.hidden_size, self.intermediate_size
        out: list[LinearShape] = []
        if self.fused_qkv:
            out.append(LinearShape("qkv_proj", self.q_dim + 2 * self.kv_dim, d, L, "attention"))
        else:
            out += [LinearShape("q_proj", self.q_dim, d, L, "attention"),
                    LinearShape("k_proj", self.kv_dim, d, L, "attention"),
                    LinearShape("v_proj", self.kv_dim, d, L, "attention")]
        out.append(LinearShape("o_proj", d, self.q_dim, L, "attention"))
        moe = self.n_moe_layers
        mlps = [("", "mlp", i, L - moe)]  # (name prefix, role, width, count)
        if moe:
            mlps += [("", "expert", self.expert_intermediate_size or i, moe * self.n_experts)]
            if self.shared_expert_size:
                mlps += [("shared_", "mlp", self.shared_expert_size, moe)]
        for pre, role, w, n in mlps:
            if n == 0:
                continue
            if self.fused_gate_up:
                out.append(LinearShape(f"{pre}gate_up_proj", 2 * w, d, n, role))
            else:
                out += [LinearShape(f"{pre}gate_proj", w, d, n, role), LinearShape(f"{pre}up_proj", w, d, n, role)]
            out.append(LinearShape(f"{pre}down_proj", d, w, n, role))
        if moe:
            out.append(LinearShape("router", self.n_experts, d, moe, "router"))
            if self.shared_expert_size:
                out.append(LinearShape("shared_expert_gate", 1, d, moe, "router"))
        out.append(LinearShape("lm_head", self.vocab_size, d, 1, "lm_head", tied=self.tie_embeddings))
        return out

    # ------------------------------------------------------------------ counts
    @property
    def n_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def n_norm_params(self) -> int:
        per_layer = self.norms_per_layer * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return self.n_layers * per_layer + self.hidden_size  # + the final norm

    @property
    def n_bias_params(self) -> int:
        per_layer = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.hidden_size * self.o_bias
        if self.mlp_bias:
            per_layer += (2 * self.intermediate_size + self.hidden_size) * max(self.n_experts, 1)
        return self.n_layers * per_layer

    def n_linear_params(self, roles: tuple[str, ...] | None = None, stored: bool = False) -> int:
        """Weights of the linear layers (optionally of some roles); `stored` drops a tied LM head."""
        return sum(s.n_params for s in self.linear_shapes()
                   if (roles is None or s.role in roles) and not (stored and s.tied))

    @property
    def n_params(self) -> int:
        """Exact parameter count of the checkpoint (a tied LM head counted once)."""
        return (self.n_linear_params(stored=True) + self.n_embedding_params + self.n_norm_params
                + self.n_bias_params)

    @property
    def n_active_params(self) -> int:
        """Parameters one token uses: all but the experts it is not routed to (== n_params if dense)."""
        if not self.is_moe:
            return self.n_params
        idle = self.n_linear_params(("expert",)) * (self.n_experts - self.experts_per_token) // self.n_experts
        if self.mlp_bias:
            idle += self.n_layers * (2 * self.intermediate_size + self.hidden_size) * (
                self.n_experts - self.experts_per_token)
        return self.n_params - idle

    @property
    def kv_values_per_token(self) -> int:
        """Cached values per token over all layers: keys and values, 2 * L * n_kv * head_dim (GQA)."""
        return 2 * self.n_layers * self.kv_dim

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query attending one key over all layers: QK^T and PV, 2 * 2 * L * n_heads * d_h."""
        return 4 * self.n_layers * self.q_dim

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ModelSpecError(f"unknown ModelSpec fields {unknown}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a file or a folder holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        cfg = read_json_file(p, "config.json", ModelSpecError)
        default_name = p.parent.name if p.name == "config.json" else p.stem
        return cls.from_config_dict(cfg, source=str(p), name=name or default_name)

    @classmethod
    def from_config_dict(cls, cfg: dict[str, Any], source: str = "config", name: str = "model") -> ModelSpec:
        """Build a spec from the fields of a config.json (see `FAMILIES` for what each family adds).
        Every size must be a JSON integer (not a string, bool, float such as 576.7, NaN or inf)."""
        if not isinstance(cfg, dict):
            raise ModelSpecError(f"{source}: a config.json holds a JSON object, got a {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if "text_config" in cfg and isinstance(cfg["text_config"], dict):  # multimodal wrappers (Gemma-3)
            inner = dict(cfg["text_config"])
            inner.setdefault("model_type", f"{model_type}_text")
            if "tie_word_embeddings" in cfg and "tie_word_embeddings" not in inner:
                inner["tie_word_embeddings"] = cfg["tie_word_embeddings"]
            cfg, model_type = inner, inner["model_type"]
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ModelSpecError(
                f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}")
        fam = FAMILIES[model_type]
        vals = {**fam.get("defaults", {}), **{k: v for k, v in cfg.items() if v is not None}}
        for alias, key in fam.get("aliases", {}).items():  # another spelling of a field (newer transformers)
            if alias in vals and key not in vals:
                vals[key] = vals[alias]

        def size(key: str, value: Any, least: int = 1) -> int:
            """A config size: an integer (an integral float such as 576.0 too) in [least, MAX_SIZE]."""
            if isinstance(value, float) and math.isfinite(value) and value.is_integer():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelSpecError(f"{source}: field {key!r} must be an integer, got {value!r:.40}")
            if not least <= value <= MAX_SIZE:
                raise ModelSpecError(f"{source}: field {key!r} must be a positive integer up to {MAX_SIZE:,}, "
                                     f"got {value}" if least else f"{source}: field {key!r} is out of range: {value}")
            return value

        def need(key: str, least: int = 1) -> int:
            if key not in vals:
                raise ModelSpecError(f"{source}: field {key!r} is missing (needed for model_type {model_type!r})")
            return size(key, vals[key], least)

        d, heads = need("hidden_size"), need("num_attention_heads")
        head_dim = size("head_dim", vals["head_dim"]) if vals.get("head_dim") else d // heads
        kv_heads = size("num_key_value_heads", vals.get("num_key_value_heads", heads))
        n_experts = need(fam["experts"][0], 0) if "experts" in fam else 0
        k_experts = need(fam["experts"][1]) if n_experts else 0
        moe_extra = _moe_fields(fam, vals, need, source) if n_experts else {}
        bias = fam.get("qkv_bias", False)
        return cls(
            name=name, family=model_type, n_layers=need("num_hidden_layers"), hidden_size=d,
            n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
            tie_embeddings=bool(vals.get("tie_word_embeddings", fam.get("tied", False))),
            n_experts=n_experts, experts_per_token=k_experts, **moe_extra,
            qkv_bias=bool(vals.get(bias, False)) if isinstance(bias, str) else bias,
            o_bias=bool(vals.get(bias, False)) if isinstance(bias, str) else False,
            mlp_bias=bool(vals.get("mlp_bias", False)) if fam.get("mlp_bias_field") else False,
            norms_per_layer=fam.get("norms", 2), qk_norm=fam.get("qk_norm", False),
            fused_qkv=fam.get("fused", False), fused_gate_up=fam.get("fused", False),
            max_position_embeddings=size("max_position_embeddings", vals.get("max_position_embeddings") or 0, 0),
        )


#: What each model_type adds to the plain Llama shape, as the transformers implementations build it.
#: qkv_bias: True (always), or the config field that switches q/k/v/o biases on.  tied: the default of
#: tie_word_embeddings when the config omits it.  defaults: values that serialised configs omit because
#: they equal the library default (nested Gemma-3 text configs do this).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"qkv_bias": "attention_bias", "mlp_bias_field": True},
    "mistral": {},
    "mixtral": {"experts": ("num_local_experts", "num_experts_per_tok")},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qkv_bias": "attention_bias", "qk_norm": True},
    "gemma": {"tied": True},
    "gemma2": {"tied": True, "norms": 4},
    "gemma3_text": {"tied": True, "norms": 4, "qk_norm": True,
                    "defaults": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                                 "vocab_size": 262208}},
    "phi3": {"fused": True},
}
FAMILIES["gemma3"] = FAMILIES["gemma3_text"]
FAMILIES["qwen3_moe"] = {**FAMILIES["qwen3"], "experts": ("num_experts", "num_experts_per_tok"),
                         "expert_size": "moe_intermediate_size", "sparse_layers": True,
                         "aliases": {"num_local_experts": "num_experts"}}  # transformers 5 writes the latter
FAMILIES["qwen2_moe"] = {**FAMILIES["qwen2"], "experts": ("num_experts", "num_experts_per_tok"),
                         "expert_size": "moe_intermediate_size", "sparse_layers": True,
                         "shared_expert": "shared_expert_intermediate_size"}


def _moe_fields(fam: dict[str, Any], vals: dict[str, Any], need: Any, source: str) -> dict[str, int]:
    """The MoE widths and the number of layers with experts, from the config fields the family names.
    Qwen-MoE: layer l has experts unless l is in mlp_only_layers or (l + 1) % decoder_sparse_step != 0
    (as transformers builds Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer)."""
    out: dict[str, int] = {}
    if "expert_size" in fam:
        out["expert_intermediate_size"] = need(fam["expert_size"])
    if "shared_expert" in fam:
        out["shared_expert_size"] = need(fam["shared_expert"], 0)
    if fam.get("sparse_layers"):
        layers = need("num_hidden_layers")
        step = need("decoder_sparse_step") if "decoder_sparse_step" in vals else 1
        dense = vals.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in dense):
            raise ModelSpecError(f"{source}: field 'mlp_only_layers' must be a list of layer indices, "
                                 f"got {dense!r:.60}")
        moe = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        if moe == 0:
            raise ModelSpecError(f"{source}: no layer holds experts (decoder_sparse_step {step}, "
                                 f"mlp_only_layers {dense[:8]})")
        out["moe_layers"] = moe
    return out


def human_count(n: int | float) -> str:
    """1234567 -> '1.23M' (for tables)."""
    if n <= 0:
        return "0"
    units = ["", "K", "M", "B", "T"]
    k = min(int(math.log10(n) // 3), len(units) - 1)
    return f"{n / 10 ** (3 * k):.3g}{units[k]}"
