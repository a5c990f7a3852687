"""Recipes: the shipped YAML files load, overrides apply with types, and bad input fails with a RecipeError
that names the key or path. No network, no model loading."""

import json
import pathlib

import pytest
import yaml

from unsloth_lite.recipes import (
    CheckpointingSection,
    LoRASection,
    Recipe,
    RecipeError,
    load_recipe,
    recipe_to_dict,
    resolve_recipe_path,
    torch_dtype,
)

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGED = REPO / "unsloth_lite" / "recipe_files"
SHIPPED = ["tiny_qwen", "qlora_qwen3_8b", "qlora_qwen27b", "qlora_qwen27b_fsdp"]

BASE = {
    "model": {"name_or_path": "Qwen/Qwen3-8B", "load_in_4bit": True, "dtype": "bfloat16"},
    "lora": {"r": 16, "alpha": 16},
    "data": {"path": "builtin:arithmetic", "format": "chat"},
    "training": {"output_dir": "runs/x", "learning_rate": 2e-4, "num_train_epochs": 1},
    "seed": 0,
}


def write(tmp_path, raw, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def with_(section, key, value):
    """A copy of BASE with one key set (section None: top level); the value `...` deletes the key."""
    raw = json.loads(json.dumps(BASE))
    target = raw if section is None else raw[section]
    if value is ...:
        del target[key]
    else:
        target[key] = value
    return raw


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_load(name):
    recipe = load_recipe(PACKAGED / f"{name}.yaml")
    assert isinstance(recipe, Recipe)
    assert recipe.training["output_dir"] == f"runs/{name}"
    assert load_recipe(name) == recipe


def test_tiny_recipe_contents():
    recipe = load_recipe("tiny_qwen")
    assert recipe.model.name_or_path == "builtin:tiny-qwen3" and recipe.model.load_in_4bit is True
    assert recipe.model.dtype == "float32" and recipe.model.max_seq_length == 128
    assert recipe.lora == LoRASection(r=128, alpha=128, dropout=0.0, target_modules="all-linear")
    assert recipe.data.path == "builtin:arithmetic" and recipe.data.format == "chat"
    assert recipe.data.eval_fraction == pytest.approx(0.1)
    assert recipe.training["learning_rate"] == pytest.approx(1.2e-3)


def test_large_recipes_use_explicit_projections():
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for name, batch, accum, kept_mlp in [("qlora_qwen3_8b", 4, 4, False), ("qlora_qwen27b", 1, 16, True)]:
        recipe = load_recipe(name)
        assert recipe.model.load_in_4bit and recipe.model.dtype == "bfloat16"
        assert recipe.lora.target_modules == projections
        assert recipe.training["per_device_train_batch_size"] == batch
        assert recipe.training["gradient_accumulation_steps"] == accum
        assert recipe.training["gradient_checkpointing"] is True
        assert recipe.checkpointing == CheckpointingSection(offload_to_cpu=True, cuda_graphs=False,
                                                            keep_mlp_preactivations=kept_mlp)


@pytest.mark.parametrize("name", ["tiny_qwen", "tiny_qwen.yaml", "recipes/tiny_qwen.yaml"])
def test_resolve_recipe_path(name, monkeypatch):
    monkeypatch.chdir(REPO)
    path = resolve_recipe_path(name)
    assert path.is_file() and path.resolve() == (PACKAGED / "tiny_qwen.yaml").resolve()


def test_resolve_recipe_path_prefers_an_existing_file(tmp_path, monkeypatch):
    path = write(tmp_path, BASE, "tiny_qwen.yaml")
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe_path("tiny_qwen.yaml") == pathlib.Path("tiny_qwen.yaml")
    assert resolve_recipe_path(str(path)) == path


def test_resolve_unknown_lists_available():
    with pytest.raises(RecipeError, match=r"no_such_recipe.*tiny_qwen"):
        resolve_recipe_path("no_such_recipe")


def test_overrides_apply_with_types():
    recipe = load_recipe(
        "tiny_qwen",
        ["lora.r=8", "training.learning_rate=2e-5", "data.chat_template=null", "seed=3", "model.load_in_4bit=true",
         "lora.target_modules=[q_proj, v_proj]", "training.gradient_checkpointing_kwargs.use_reentrant=false"],
    )
    assert recipe.lora.r == 8 and type(recipe.lora.r) is int
    assert recipe.training["learning_rate"] == 2e-5 and type(recipe.training["learning_rate"]) is float
    assert recipe.data.chat_template is None
    assert recipe.seed == 3
    assert recipe.model.load_in_4bit is True
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]
    assert recipe.training["gradient_checkpointing_kwargs"] == {"use_reentrant": False}


def test_overrides_keep_text_where_a_key_takes_text():
    # YAML reads `no` as false and `1` as an int; these keys take strings, so the text is kept as written.
    recipe = load_recipe("tiny_qwen", ["training.save_strategy=no", "training.report_to=none", "data.split=1"])
    assert recipe.training["save_strategy"] == "no"
    assert recipe.data.split == "1"
    # a key that takes a bool still gets one
    assert load_recipe("tiny_qwen", ["training.bf16=no"]).training["bf16"] is False


def test_defaults_and_optional_sections(tmp_path):
    raw = {k: v for k, v in BASE.items() if k not in ("lora", "seed")}
    recipe = load_recipe(write(tmp_path, raw))
    assert recipe.lora == LoRASection() and recipe.seed == 42
    assert recipe.data.split == "train" and recipe.data.train_on_responses_only is True


@pytest.mark.parametrize(("data_format", "packed"), [("alpaca", True), ("chat", True), ("text", False),
                                                      ("tokenized", False)])
def test_packing_default_per_format(data_format, packed, tmp_path):
    """Packing is on by default for the instruction formats; `false` (or `true`) given is kept."""
    raw = {**BASE, "data": {"path": "org/data", "format": data_format}}
    recipe = load_recipe(write(tmp_path, raw))
    assert recipe.data.packing is packed and recipe.data.packing_tokens == 8192
    assert load_recipe(write(tmp_path, raw), [f"data.packing={str(not packed).lower()}"]).data.packing is not packed
    assert load_recipe(recipe_to_dict_path(tmp_path, recipe)).data.packing is packed


def recipe_to_dict_path(tmp_path, recipe):
    return write(tmp_path, yaml.safe_dump(recipe_to_dict(recipe)), name="round_trip.yaml")


def test_shipped_recipes_packing():
    assert load_recipe("qlora_qwen3_8b").data.packing is True
    assert load_recipe("qlora_qwen3_8b", ["data.packing=false"]).data.packing is False
    assert load_recipe("tiny_qwen").data.packing is False


def test_checkpointing_section(tmp_path):
    assert load_recipe(write(tmp_path, BASE)).checkpointing == CheckpointingSection()
    raw = {**BASE, "training": {**BASE["training"], "gradient_checkpointing": True},
           "checkpointing": {"offload_to_cpu": True}}
    recipe = load_recipe(write(tmp_path, raw),
                         ["checkpointing.cuda_graphs=true", "checkpointing.uncheckpointed_layers=4",
                          "checkpointing.keep_mlp_preactivations=true"])
    assert recipe.checkpointing == CheckpointingSection(offload_to_cpu=True, cuda_graphs=True, uncheckpointed_layers=4,
                                                        keep_mlp_preactivations=True)
    with pytest.raises(RecipeError, match=r"^checkpointing\.keep_mlp_preactivations: "):
        load_recipe(write(tmp_path, raw), ["checkpointing.keep_mlp_preactivations=often"])
    counted = load_recipe(write(tmp_path, raw), ["checkpointing.keep_mlp_preactivations=24",
                                                 "checkpointing.mlp_preactivations_on_gpu=8"]).checkpointing
    assert (counted.keep_mlp_preactivations, counted.mlp_preactivations_on_gpu) == (24, 8)
    with pytest.raises(RecipeError, match=r"^checkpointing\.keep_mlp_preactivations: must be >= 0, got -2"):
        load_recipe(write(tmp_path, raw), ["checkpointing.keep_mlp_preactivations=-2"])
    projections = load_recipe(write(tmp_path, raw), ["checkpointing.keep_projection_outputs=36"]).checkpointing
    assert projections.keep_projection_outputs == 36
    with pytest.raises(RecipeError, match=r"^checkpointing\.keep_projection_outputs: must be >= 0, got -1"):
        load_recipe(write(tmp_path, raw), ["checkpointing.keep_projection_outputs=-1"])


def test_resume_from_checkpoint_bool_or_path(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-100"
    checkpoint.mkdir(parents=True)
    raw = with_("training", "output_dir", str(tmp_path / "run"))
    raw["training"]["resume_from_checkpoint"] = True
    assert load_recipe(write(tmp_path, raw)).training["resume_from_checkpoint"] is True
    raw["training"]["resume_from_checkpoint"] = str(checkpoint)
    assert load_recipe(write(tmp_path, raw)).training["resume_from_checkpoint"] == str(checkpoint)
    raw["training"]["resume_from_checkpoint"] = True
    raw["training"]["output_dir"] = str(tmp_path / "new")
    with pytest.raises(RecipeError, match=r"^training\.resume_from_checkpoint: true, but .*new holds no checkpoint"):
        load_recipe(write(tmp_path, raw))


def test_local_checkpoint_and_data(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    raw = json.loads(json.dumps(BASE))
    raw["model"]["name_or_path"] = str(ckpt)
    raw["data"].update(path=str(data), chat_template=str(template))
    recipe = load_recipe(write(tmp_path, raw))
    assert recipe.model.name_or_path == str(ckpt) and recipe.data.path == str(data)
    inline = "{{ messages[0].content }}"
    assert load_recipe(write(tmp_path, raw), [f"data.chat_template='{inline}'"]).data.chat_template == inline


def test_recipe_to_dict_round_trips(tmp_path):
    for name in SHIPPED:
        recipe = load_recipe(name, ["seed=7"])
        dumped = yaml.safe_dump(recipe_to_dict(recipe))
        assert yaml.safe_load(dumped) == recipe_to_dict(recipe)
        assert load_recipe(write(tmp_path, dumped)) == recipe


def test_torch_dtype():
    import torch

    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float32") is torch.float32
    with pytest.raises(RecipeError, match="fp16"):
        torch_dtype("fp16")


def _llama_dir(tmp_path):
    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(ckpt)


BAD_FILES = {
    "unknown top-level key": (lambda t: with_(None, "foo", 1), r"unknown key 'foo' \(expected one of: model, lora"),
    "unknown section key": (lambda t: with_("lora", "rank", 8), r"unknown key 'lora\.rank' \(expected one of: r, "),
    "unknown training key": (
        lambda t: with_("training", "learnig_rate", 1e-4), r"training\.learnig_rate.*'learning_rate'"
    ),
    "wrong type": (lambda t: with_("lora", "r", "abc"), r"^lora\.r: expected int, got str 'abc'$"),
    "bool for int": (lambda t: with_("lora", "r", True), r"^lora\.r: expected int, got bool True$"),
    "int for bool": (lambda t: with_("model", "load_in_4bit", 1), r"^model\.load_in_4bit: expected bool"),
    "training str for float": (
        lambda t: with_("training", "learning_rate", "abc"), r"^training\.learning_rate: expected float"
    ),
    "training bool for float": (
        lambda t: with_("training", "num_train_epochs", True), r"^training\.num_train_epochs: "
    ),
    "training list type": (lambda t: with_("training", "report_to", [1]), r"^training\.report_to: "),
    "lora.r out of range": (lambda t: with_("lora", "r", 0), r"^lora\.r: must be >= 1"),
    "dropout out of range": (lambda t: with_("lora", "dropout", 1.0), r"^lora\.dropout: must be in \[0, 1\)"),
    "eval_fraction out of range": (lambda t: with_("data", "eval_fraction", -0.1), r"^data\.eval_fraction: "),
    "max_seq_length out of range": (lambda t: with_("model", "max_seq_length", 0), r"^model\.max_seq_length: "),
    "bad dtype": (
        lambda t: with_("model", "dtype", "fp16"), r"^model\.dtype: expected one of float32, bfloat16, float16"
    ),
    "bad format": (lambda t: with_("data", "format", "sharegpt"), r"^data\.format: expected one of alpaca, chat, text"),
    "bad attn": (lambda t: with_("model", "attn_implementation", "flash"), r"^model\.attn_implementation: .*sdpa"),
    "missing model name": (
        lambda t: with_("model", "name_or_path", ...), r"missing required key\(s\): model\.name_or_path"
    ),
    "missing data keys": (lambda t: {**BASE, "data": {}}, r"missing required key\(s\): data\.path, data\.format"),
    "missing section": (
        lambda t: {k: v for k, v in BASE.items() if k != "data"}, r"missing required section\(s\): data"
    ),
    "missing output_dir": (lambda t: with_("training", "output_dir", ...), r"^training\.output_dir: required"),
    "training seed": (lambda t: with_("training", "seed", 1), r"^training\.seed: set the top-level 'seed'"),
    "bool seed": (lambda t: with_(None, "seed", False), r"^seed: expected int"),
    "checkpointing without gradient checkpointing": (
        lambda t: {**BASE, "checkpointing": {"offload_to_cpu": True}},
        r"^checkpointing: its options need training\.gradient_checkpointing: true$",
    ),
    "packing_tokens out of range": (
        lambda t: with_("data", "packing_tokens", 0), r"^data\.packing_tokens: must be >= 1, got 0$"
    ),
    "packing_tokens below max_seq_length": (
        lambda t: with_("data", "packing_tokens", 512),
        r"^data\.packing_tokens: 512 cannot hold a document of model\.max_seq_length 2048 tokens",
    ),
    "packing not a bool": (lambda t: with_("data", "packing", "yes please"), r"^data\.packing: expected bool or null"),
    "pad_to_multiple_of out of range": (
        lambda t: with_("data", "pad_to_multiple_of", 0), r"^data\.pad_to_multiple_of: must be >= 1, got 0$"
    ),
    "unknown checkpointing key": (
        lambda t: {**BASE, "checkpointing": {"offload": True}}, r"unknown key 'checkpointing\.offload'"
    ),
    "non-qwen checkpoint": (
        lambda t: with_("model", "name_or_path", _llama_dir(t)),
        r"^model\.name_or_path: .*llama is a 'llama' checkpoint; supported model types: qwen2, qwen3",
    ),
    "checkpoint without config": (
        lambda t: with_("model", "name_or_path", str(t)), r"^model\.name_or_path: .* config\.json"
    ),
    "missing local model": (
        lambda t: with_("model", "name_or_path", str(t / "nope")), r"^model\.name_or_path: .*nope does not exist"
    ),
    "missing relative model": (
        lambda t: with_("model", "name_or_path", "./nope"), r"^model\.name_or_path: \./nope does not exist"
    ),
    "bad hub model name": (lambda t: with_("model", "name_or_path", "qwen 3"), r"^model\.name_or_path: 'qwen 3'"),
    "unknown builtin model": (
        lambda t: with_("model", "name_or_path", "builtin:big"), r"^model\.name_or_path: .*tiny-qwen3"
    ),
    "missing local data": (
        lambda t: with_("data", "path", str(t / "nope.jsonl")), r"^data\.path: .*nope\.jsonl does not exist"
    ),
    "missing bare data file": (
        lambda t: with_("data", "path", "train.jsonl"), r"^data\.path: train\.jsonl does not exist"
    ),
    "missing chat template file": (
        lambda t: with_("data", "chat_template", "x.jinja"), r"^data\.chat_template: x\.jinja"
    ),
    "section not a mapping": (lambda t: with_(None, "lora", [1]), r"^lora: expected a mapping"),
    "non-mapping top level": (lambda t: [1, 2], r"recipe\.yaml: expected a mapping"),
    "yaml syntax error": (
        lambda t: "model:\n  name_or_path: a\n  dtype: [bfloat16\nlora: {}\n", r"recipe\.yaml:\d+: invalid YAML"
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_recipe_files(case, tmp_path):
    make, pattern = BAD_FILES[case]
    with pytest.raises(RecipeError, match=pattern) as info:
        load_recipe(write(tmp_path, make(tmp_path)))
    assert "\n" not in str(info.value)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "model:\n  name_or_path: Qwen/Qwen3-8B\n  dtype: : bad\n")
    with pytest.raises(RecipeError, match=rf"{path.name}:3: invalid YAML"):
        load_recipe(path)


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match=r"nope\.yaml does not exist"):
        load_recipe(tmp_path / "nope.yaml")


BAD_OVERRIDES = {
    "no equals": ("foo", r"^override 'foo' must look like section\.key=value$"),
    "section only": ("lora=8", r"must look like section\.key=value"),
    "unknown section": ("optim.lr=1", r"unknown key 'optim\.lr' \(expected one of: model, lora"),
    "unknown section key": ("lora.rank=8", r"unknown key 'lora\.rank'"),
    "unknown training key": ("training.lr=1e-4", r"unknown key 'training\.lr'"),
    "sub-key of scalar": ("lora.r.x=1", r"lora\.r has no sub-keys"),
    "wrong type": ("lora.r=abc", r"^lora\.r: expected int, got str 'abc'$"),
    "training wrong type": ("training.learning_rate=abc", r"^training\.learning_rate: expected float"),
    "null required": ("data.path=null", r"^data\.path: expected str, got null$"),
    "bad yaml value": ("lora.target_modules=[a", r"override 'lora\.target_modules=\[a': value is not valid YAML"),
    "negative learning rate": ("training.learning_rate=-1", r"^training\.learning_rate: must be > 0, got -1$"),
    "zero batch": ("training.per_device_train_batch_size=0", r"^training\.per_device_train_batch_size: must be >= 1"),
    "zero max_steps": ("training.max_steps=0", r"^training\.max_steps: must be >= 1 \(or -1"),
    "zero logging_steps": ("training.logging_steps=0", r"^training\.logging_steps: must be > 0"),
    "unknown optimiser": ("training.optim=adamw_foo", r"^training\.optim: unknown value 'adamw_foo'; did you mean"),
    "unknown scheduler": ("training.lr_scheduler_type=cosinus", r"^training\.lr_scheduler_type: .*'cosine'"),
    "unknown logger": ("training.report_to=[tensorboard, foo]", r"^training\.report_to: unknown integration 'foo'"),
    "beta out of range": ("training.adam_beta2=1", r"^training\.adam_beta2: must be in \[0, 1\)"),
}


@pytest.mark.parametrize("case", list(BAD_OVERRIDES))
def test_bad_overrides(case):
    override, pattern = BAD_OVERRIDES[case]
    with pytest.raises(RecipeError, match=pattern):
        load_recipe("tiny_qwen", [override])


def test_fsdp_recipe_and_its_checks():
    recipe = load_recipe("qlora_qwen27b_fsdp")
    assert recipe.training["fsdp"] == "full_shard auto_wrap" and recipe.training["fsdp_config"]["version"] == 2
    assert recipe.checkpointing.cuda_graphs is False and recipe.model.quantize_embeddings is False
    for override, key in [("training.fsdp_config={version: 1}", "training.fsdp_config.version"),
                          ("checkpointing.cuda_graphs=true", "checkpointing.cuda_graphs"),
                          ("model.quantize_embeddings=true", "model.quantize_embeddings")]:
        with pytest.raises(RecipeError, match=rf"^{key}: ") as error:
            load_recipe("qlora_qwen27b_fsdp", [override])
        assert "\n" not in str(error.value)
    # without FSDP the same options are fine
    unsharded = load_recipe("qlora_qwen27b_fsdp", ["training.fsdp=", "checkpointing.cuda_graphs=true"])
    assert unsharded.checkpointing.cuda_graphs
