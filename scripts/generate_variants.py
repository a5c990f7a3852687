"""The variants of `bench_generate.py` and the decoding settings an unsloth-lite variant may carry.

An unsloth-lite variant may carry decoding settings after `@`, `/`-separated, set in its worker so that one run
compares them (`unsloth_lite@stages=3/lora_stages=3`, `unsloth_lite_lora@flat=0`). Numbers: `stages=N`
(`nf4_matvec.PIPELINE_STAGES`, the NF4 loop's loads kept N tiles ahead), `lora_stages=N` (`lora_down`'s).
Switches, 0 or 1, the default first: `lora_split=1` and `lora_pdl=0` (`lora_down.SPLIT_K`, `lora_down.PDL`),
`flat=1` (`nf4_matvec.FLAT_ABSMAX`; 0: the nested absmax read in the kernel), `pdl=1` (`nf4_matvec.PDL`; 0:
ordinary launches instead of programmatic dependent ones, each of which starts loading its weight while the
kernel before it finishes), `words=1` (`nf4_matvec.WORD_KERNEL`: the weight read as words of eight codes),
`prefetch=0` (`nf4_matvec.REGISTER_PREFETCH`: the word kernel's next tile loaded into registers a step ahead),
`gated=1` (`decode.GATED_MATVEC`: each MLP's gate and up products and SwiGLU in one launch), `grouped=1`
(`decode.GROUPED_MATVEC`: the projections of one input in one launch), `attention=1` (`decode.DECODE_ATTENTION`:
each full-attention layer's cache update, attention and output gate in one launch), `deltanet=0`
(`decode.GATED_DELTANET_STEP`: each DeltaNet layer's gates, step and gated norm in one launch), `residual=1`
(`decode.RESIDUAL_IN_PRODUCTS`: each layer's residual adds in its output projections' epilogues), `norm=1`
(`decode.NORM_FIRST_PRODUCTS`: each norm and the first products of the adapters after it in one launch),
`small_pdl=1` (`kernels.utils.DECODE_PDL`: the small decoding kernels as programmatic dependent launches),
`greedy=1` (`decode_loop.GREEDY_TOKEN_KERNEL`: a greedy step's token chosen and recorded in one launch),
`norm_rope=1` (`decode.NORM_ROPE_IN_ATTENTION`: the q/k norm and RoPE inside the attention's launch), `screened=1`
(`decode.SCREENED_LM_HEAD`, with `greedy=1`: the lm_head screened by an int8 copy), `first=1`
(`nf4_matvec.FIRST_PRODUCTS_IN_LAUNCH`: the adapters' first products in their projections' own launches, the
norms alone), `norm_bound=1` (`screened_logits.NORM_BOUND`: the screen's bound also by Cauchy–Schwarz),
`pair_products=0` (`nf4_matvec.BF16_PAIR_PRODUCTS`: the word walk's products in bf16 pairs, else in fp32),
`mlp_shares=1` (`decode.MLP_SHARES`: down_proj's adapter's first product from the gate-and-up launch, in
stripes), `screen_int8=1` (`screened_logits.INT8_PRODUCTS`: the screen's integer products of x's int8
parts), `t_early=1` (`matvec_epilogue.T_BEFORE_WALK`: an adapter's given t loaded before the walk), `gluon=1`
(`nf4_matvec.GLUON_WALK`: the word launch's one-row products walked in Gluon where they fit), `gluon_gated=0`
(`nf4_gated_matvec.GLUON_GATED`, with `gluon=1`: the gate-and-up launch's too), `gluon_grouped=0`
(`nf4_grouped_matvec.GLUON_GROUPED`, with `gluon=1`: the grouped launch's too), `gluon_first=0`
(`nf4_matvec.GLUON_FIRST_PRODUCTS`, with `gluon=1`: o_proj's product with its adapter's first product in the launch
too) and the
number `screen_block=N` (`screened_logits.INT8_BLOCK_N`, the head's rows a program of that screen). A suffixed
adapter variant's `lora_cost` is against `unsloth_lite` with the same suffix, less `adapted`:
`unsloth_lite_lora@adapted=N` puts adapters on some projections only, N the sum of 1 (q, k, v), 2 (o), 4 (gate,
up) and 8 (down; 15, the default: all seven), so that one run splits the adapter's cost by projection.

A timing bound, not a configuration: `unsloth_lite@norms_skipped=1` leaves out the decoder layers' RMSNorm
launches (each layer's input passed on as its norms' output: the tokens are wrong, the launches otherwise the
same), so that one run gives the most that taking the norms into the products' launches could save.
"""

from __future__ import annotations

from bench_common import setting_in_range

VARIANTS = ("hf", "hf_static", "unsloth", "unsloth_lite", "unsloth_lite_lora", "unsloth_lite_hf_loop")
DEFAULT_VARIANTS = VARIANTS[:-1]
# A variant's "@" settings: key -> (module, attribute, least value); see the module docstring.
DECODE_SETTINGS = {
    "stages": ("unsloth_lite.kernels.nf4_matvec", "PIPELINE_STAGES", 1),
    "lora_stages": ("unsloth_lite.kernels.lora_down", "PIPELINE_STAGES", 1),
    "lora_split": ("unsloth_lite.kernels.lora_down", "SPLIT_K", 0),
    "lora_pdl": ("unsloth_lite.kernels.lora_down", "PDL", 0),
    "flat": ("unsloth_lite.kernels.nf4_matvec", "FLAT_ABSMAX", 0),
    "pdl": ("unsloth_lite.kernels.nf4_matvec", "PDL", 0),
    "words": ("unsloth_lite.kernels.nf4_matvec", "WORD_KERNEL", 0),
    "prefetch": ("unsloth_lite.kernels.nf4_matvec", "REGISTER_PREFETCH", 0),
    "gated": ("unsloth_lite.models.decode", "GATED_MATVEC", 0),
    "grouped": ("unsloth_lite.models.decode", "GROUPED_MATVEC", 0),
    "attention": ("unsloth_lite.models.decode", "DECODE_ATTENTION", 0),
    "deltanet": ("unsloth_lite.models.decode", "GATED_DELTANET_STEP", 0),
    "residual": ("unsloth_lite.models.decode", "RESIDUAL_IN_PRODUCTS", 0),
    "norm": ("unsloth_lite.models.decode", "NORM_FIRST_PRODUCTS", 0),
    "small_pdl": ("unsloth_lite.kernels.utils", "DECODE_PDL", 0),
    "greedy": ("unsloth_lite.models.decode_loop", "GREEDY_TOKEN_KERNEL", 0),
    "norm_rope": ("unsloth_lite.models.decode", "NORM_ROPE_IN_ATTENTION", 0),
    "screened": ("unsloth_lite.models.decode", "SCREENED_LM_HEAD", 0),
    "first": ("unsloth_lite.kernels.nf4_matvec", "FIRST_PRODUCTS_IN_LAUNCH", 0),
    "norm_bound": ("unsloth_lite.kernels.screened_logits", "NORM_BOUND", 0),
    "pair_products": ("unsloth_lite.kernels.nf4_matvec", "BF16_PAIR_PRODUCTS", 0),
    "mlp_shares": ("unsloth_lite.models.decode", "MLP_SHARES", 0),
    "screen_int8": ("unsloth_lite.kernels.screened_logits", "INT8_PRODUCTS", 0),
    "screen_block": ("unsloth_lite.kernels.screened_logits", "INT8_BLOCK_N", 16),
    "t_early": ("unsloth_lite.kernels.matvec_epilogue", "T_BEFORE_WALK", 0),
    "gluon": ("unsloth_lite.kernels.nf4_matvec", "GLUON_WALK", 0),
    "gluon_gated": ("unsloth_lite.kernels.nf4_gated_matvec", "GLUON_GATED", 0),
    "gluon_grouped": ("unsloth_lite.kernels.nf4_grouped_matvec", "GLUON_GROUPED", 0),
    "gluon_first": ("unsloth_lite.kernels.nf4_matvec", "GLUON_FIRST_PRODUCTS", 0),
}
# `@adapted=N`'s groups of adapted projections: bit -> their names (module docstring)
ADAPTED_GROUPS = {1: ("q_proj", "k_proj", "v_proj"), 2: ("o_proj",), 4: ("gate_proj", "up_proj"), 8: ("down_proj",)}


def split_variant(variant: str) -> tuple[str, dict]:
    """(the variant's name, its "@" settings as {key: whole number}); ValueError for an unknown name, key or
    value, or settings on a variant that is not unsloth-lite's."""
    name, _, suffix = variant.partition("@")
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; expected among {', '.join(VARIANTS)}")
    settings = {}
    for item in filter(None, suffix.split("/")):
        key, _, value = item.partition("=")
        if key == "adapted" and name == "unsloth_lite_lora" and value.isdigit() and 1 <= int(value) <= 15:
            settings[key] = int(value)
            continue
        if key == "norms_skipped" and name == "unsloth_lite" and value == "1":
            settings[key] = 1
            continue
        least = DECODE_SETTINGS[key][2] if key in DECODE_SETTINGS else None
        if least is None or not value.isdigit() or not setting_in_range(int(value), least):
            raise ValueError(f"{variant}: expected @KEY=N/... with KEY among {', '.join(DECODE_SETTINGS)} "
                             f"(stages at least 1, switches 0 or 1; adapted=1..15 on unsloth_lite_lora), "
                             f"got {item!r}")
        settings[key] = int(value)
    if settings and not name.startswith("unsloth_lite"):
        raise ValueError(f"{variant}: only unsloth-lite's variants take @ settings")
    return name, settings


def skip_layer_norms() -> None:
    """`@norms_skipped=1` (module docstring): each decoder layer's norms on the decoding path return their input."""
    import contextlib

    from unsloth_lite.models import decoder_layer

    decoder_layer._normed = lambda norm, x, *args, **kwargs: (x, contextlib.nullcontext())
