"""Config composition, CLI overrides, errors that name file and field, and the config.toml round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from lmforge.config import ConfigError, TrainConfig, dump_toml, load_train_config
from lmforge.config.loader import compose, parse_value
from tests.conftest import arch_toml, tiny_llama

BASE = (
    """
max_steps = 10
output_dir = "runs/x"

"""
    + arch_toml(tiny_llama(num_key_value_heads=None, max_position_embeddings=1024))
    + """
[data]
type = "fake"
seq_len = 128
batch_tokens = 1024
micro_batch_tokens = 256

[optim]
lr = 1e-3
"""
)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "base.toml"
    path.write_text(BASE)
    return path


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error_of(argv: list[str], world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_train_config(argv, world_size)
    return str(info.value)


def test_files_merge_left_to_right_and_flags_win(base: Path, tmp_path: Path) -> None:
    over = write(tmp_path, "over.toml", "[data]\nseq_len = 256\nseed = 7\n[optim]\nlr = 2e-3\n")
    config, raw = load_train_config(["@", str(base), "@", over, "--optim.lr", "5e-4", "--data.micro-batch-tokens=512"])
    assert config.data.seq_len == 256  # later file wins
    assert config.data.seed == 7
    assert config.data.batch_tokens == 1024  # kept from the first file (deep merge, not replacement)
    assert config.optim.lr == 5e-4  # the flag beats both files
    assert config.data.micro_batch_tokens == 512
    assert raw.source_of("data.seq_len") == over
    assert raw.source_of("optim.lr") == "the command line"
    assert raw.source_of("data.batch_tokens") == str(base)


def test_bool_flags_and_attached_at(base: Path) -> None:
    config, _ = load_train_config([f"@{base}", "--model.compile", "--no-data.document-masking"])
    assert config.model.compile is True
    assert config.data.document_masking is False
    config, _ = load_train_config([f"@{base}", "--model.compile", "--no-model.compile"])
    assert config.model.compile is False


def test_parse_value_reads_toml_scalars_and_lists() -> None:
    assert parse_value("2048") == 2048
    assert parse_value("3e-4") == 3e-4
    assert parse_value("true") is True
    assert parse_value('["a", "b"]') == ["a", "b"]
    assert parse_value("runs/x") == "runs/x"


def test_optimizer_type_defaults_to_muon_for_pretraining(base: Path) -> None:
    config, _ = load_train_config(["@", str(base)])
    assert config.optim.type == "muon"
    assert load_train_config(["@", str(base), "--optim.type", "adamw"])[0].optim.type == "adamw"


def test_unknown_field_names_file_and_field(base: Path, tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.toml", "[data]\nseq_lenn = 3\n")
    msg = error_of(["@", str(base), "@", bad])
    assert "data.seq_lenn" in msg and bad in msg and "unknown field" in msg and "seq_len" in msg


@pytest.mark.parametrize("model_type", ["llama", "glm4_moe"])
def test_an_unknown_arch_field_lists_the_fields_of_its_own_architecture(base: Path, model_type: str) -> None:
    from lmforge.config.arch import Glm4MoeArch, LlamaArch

    msg = error_of(["@", str(base), "--model.arch.model-type", model_type, "--model.arch.n-rooted-experts", "8"])
    line = next(x for x in msg.splitlines() if "n_rooted_experts" in x)
    listed = line.split("known fields here: ")[1].rstrip(")").split(", ")
    arch = Glm4MoeArch if model_type == "glm4_moe" else LlamaArch
    assert listed == list(arch.model_fields), line


def test_errors_name_the_source_that_set_the_field_or_a_field_inside_it(base: Path, tmp_path: Path) -> None:
    # An unknown section set by a flag alone comes from the command line, not from the defaults.
    assert "pipeline (from the command line): unknown field" in error_of(["@", str(base), "--pipeline.stages", "2"])
    assert "parallel.ppp (from the command line): unknown field" in error_of(["@", str(base), "--parallel.ppp", "2"])
    # A cross-field check names the source too (one process cannot split rows over two).
    msg = error_of(["@", str(base), "--parallel.cp", "2"])
    assert "parallel.cp (from the command line): 2 does not divide the world size 1" in msg
    # A table from a file with one field from a flag: both made the value the check refused.
    init = write(tmp_path, "init.toml", "[model.init]\nstd = 0.02\n")
    msg = error_of(["@", str(base), "@", init, "--model.init.scheme", "completep"])
    assert f"model.init (from {init} and the command line): " in msg and "base_hidden_size" in msg
    msg = error_of(["@", str(base), "--model.init.scheme", "completep"])
    assert f"model.init (from {base} and the command line): " in msg  # [model] itself comes from base.toml


def test_wrong_type_names_file_field_and_value(base: Path) -> None:
    msg = error_of(["@", str(base), "--data.seq-len", "long"])
    assert "data.seq_len" in msg and "the command line" in msg and "integer" in msg and "'long'" in msg


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_infinite_and_nan_numbers_are_refused(base: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"optim.lr \(from the command line\): Input should be a finite number"):
        load_train_config(["@", str(base), "--optim.lr", value])


def test_a_union_of_a_name_and_a_table_reports_the_member_meant(base: Path) -> None:
    # `val.sets` items are a set name or a table: a table is checked as a table, anything else as a name
    with pytest.raises(ConfigError) as err:
        load_train_config(["@", str(base), "--val.sets", '[1, {name = "a/b", path = "x"}]'])
    lines = str(err.value).splitlines()[1:]
    assert lines == [
        "  val.sets.0 (from the command line): Input should be a valid string, got 1",
        "  val.sets.1.name (from the command line): String should match pattern '^[A-Za-z0-9_.-]+$', got 'a/b'",
    ]


def test_a_set_file_table_takes_a_convention_and_a_folder_table_does_not(base: Path) -> None:
    sets = '["a", {name = "b", convention = "lmeval"}, {name = "c"}, {name = "held", path = "x"}]'
    cfg, _ = load_train_config(["@", str(base), "--val.sets", sets, "--val.data-dir", "evals"])
    assert cfg.val.files() == [("a", "lmforge"), ("b", "lmeval"), ("c", "lmforge")]
    cfg, _ = load_train_config(
        ["@", str(base), "--val.sets", sets, "--val.data-dir", "evals", "--val.convention", "lmeval"]
    )
    assert cfg.val.files() == [("a", "lmeval"), ("b", "lmeval"), ("c", "lmeval")]
    bad = '[{name = "b", convention = "harness"}, {name = "h", path = "x", convention = "lmeval"}]'
    with pytest.raises(ConfigError) as err:
        load_train_config(["@", str(base), "--val.sets", bad, "--val.data-dir", "evals"])
    lines = str(err.value).splitlines()[1:]
    assert lines == [
        "  val.sets.0.convention (from the command line): Input should be 'lmforge' or 'lmeval', got 'harness'",
        "  val.sets.1.convention (from the command line): unknown field",
    ]


def test_missing_required_field() -> None:
    msg = error_of(["--max-steps", "3"])
    assert "output_dir: required field is missing" in msg
    assert "[data]" in msg and "[model]" in msg and "[optim]" in msg


def test_missing_nested_field(base: Path, tmp_path: Path) -> None:
    text = BASE.replace("lr = 1e-3\n", "")
    msg = error_of(["@", write(tmp_path, "nolr.toml", text)])
    assert "optim.lr: required field is missing" in msg


def test_batch_tokens_must_divide_by_micro_batch_times_world(base: Path) -> None:
    load_train_config(["@", str(base)], world_size=4)  # 1024 = 256 x 4
    msg = error_of(["@", str(base)], world_size=8)
    assert "data.batch_tokens" in msg and str(base) in msg and "256 x 8" in msg


def test_micro_batch_must_hold_whole_windows(base: Path) -> None:
    msg = error_of(["@", str(base), "--data.micro-batch-tokens", "200", "--data.batch-tokens", "800"])
    assert "data.micro_batch_tokens" in msg and "seq_len" in msg


def test_seq_len_above_max_position_embeddings(base: Path) -> None:
    msg = error_of(["@", str(base), "--data.seq-len", "2048", "--data.micro-batch-tokens", "2048",
                    "--data.batch-tokens", "4096"])  # fmt: skip
    assert "data.seq_len" in msg and "max_position_embeddings (1024)" in msg


def test_bad_union_tag_names_the_tag_field(base: Path) -> None:
    msg = error_of(["@", str(base), "--model.arch.model-type", "gpt2"])
    assert "model.arch.model_type (from the command line)" in msg and "'llama'" in msg and "'gpt2'" in msg


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    assert "does not exist" in error_of(["@", str(tmp_path / "nope.toml")])
    bad = write(tmp_path, "broken.toml", "max_steps = = 3")
    assert bad in error_of(["@", bad])


def test_stray_argument_is_rejected(base: Path) -> None:
    assert "unexpected argument" in error_of(["@", str(base), "oops"])


def test_dump_loads_back_unchanged(base: Path, tmp_path: Path) -> None:
    config, _ = load_train_config(["@", str(base), "--model.arch.num-key-value-heads", "2", "--schedule.decay-shape",
                                   "sqrt", "--optim.eps", "1e-10"])  # fmt: skip
    dumped = write(tmp_path, "config.toml", dump_toml(config))
    again, _ = load_train_config(["@", dumped])
    assert again == config
    assert dump_toml(again) == dump_toml(config)


def test_dry_run_flag_is_recorded(base: Path) -> None:
    assert compose(["@", str(base), "--dry-run"]).dry_run


def _all_sections(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    from typing import get_args

    seen.add(model)
    for info in model.model_fields.values():
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                if ann not in seen:
                    _all_sections(ann, seen)
            else:
                stack.extend(get_args(ann))


def test_every_field_has_a_docstring() -> None:
    sections: set[type[BaseModel]] = set()
    _all_sections(TrainConfig, sections)
    assert len(sections) >= 8
    undocumented = [
        f"{s.__name__}.{name}" for s in sections for name, info in s.model_fields.items() if not info.description
    ]
    assert not undocumented


def test_every_field_is_documented() -> None:
    import re

    docs = Path(__file__).parents[2] / "docs"
    text = "".join(page.read_text() for page in sorted(docs.glob("*.md")))
    sections: set[type[BaseModel]] = set()
    _all_sections(TrainConfig, sections)
    missing = [
        f"{s.__name__}.{name}"
        for s in sections
        for name, info in s.model_fields.items()
        if not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel))
        and not re.search(rf"`(\w+\.)?{info.alias or name}`", text)
    ]
    assert not missing


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "examples").rglob("*.toml")), ids=str)
def test_example_configs_are_valid(path: Path, tmp_path: Path) -> None:
    args = ["@", str(path)]
    name = compose(args).values.get("model", {}).get("name")
    if name is not None and not Path(name).exists():
        # The SFT example starts from the demo's export: stand in the demo's architecture as `lmforge export`
        # writes it, so the example is checked against the model it is meant for.
        from lmforge.hf.folder import write_model_files

        demo, _ = load_train_config(["@", str(path.parents[1] / "pretrain" / "demo.toml")])
        assert demo.model.arch is not None
        write_model_files(tmp_path / "demo", demo.model.arch, 4096, None)
        args += ["--model.name", str(tmp_path / "demo"), "--tokenizer.name", "data/demo/tokenizer"]
    # An example written for a cluster ([deployment]) is checked at its own world size, the others at 1 and 2.
    deployment = compose(args).values.get("deployment")
    worlds = [deployment.get("num_nodes", 1) * deployment.get("procs_per_node", 1)] if deployment else [1, 2]
    for world_size in worlds:
        config, _ = load_train_config(args, world_size)
        assert config.max_steps > 0
