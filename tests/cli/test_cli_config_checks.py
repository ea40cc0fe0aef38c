"""Config, command-line and config-file checks at their boundaries (mutation round 12, auditor BM), all in process."""
from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest

from lightlike.config import FitConfig, check_keys, other_name_hint, toml_value
from lightlike.errors import ConfigError


def config_error(**kw) -> str:
    with pytest.raises(ConfigError) as e:
        FitConfig(**kw)
    return str(e.value)


# -- config.py: number checks at their boundaries ----------------------------------------------
@pytest.mark.parametrize("name", ["batch_size", "grad_accum_steps", "log_every"])
def test_counts_refuse_zero(name):
    assert config_error(**{name: 0}) == f"{name} must be a positive int, got 0"
    assert getattr(FitConfig(**{name: 1}), name) == 1


@pytest.mark.parametrize("name", ["eval_batch_size", "eval_every", "save_every", "save_total_limit"])
def test_optional_counts_refuse_zero(name):
    assert config_error(**{name: 0}) == f"{name} must be a positive int or None, got 0"
    assert getattr(FitConfig(**{name: 1}), name) == 1


def test_warmup_steps_refuses_minus_one():
    assert config_error(warmup_steps=-1) == "warmup_steps must be >= 0, got -1"


def test_log_levels_are_read_without_case_or_spaces():
    assert FitConfig(log_level=" WARNING ", log_level_other_ranks="Error").log_level == " WARNING "
    assert config_error(log_level="verbose") == (
        "log_level='verbose' is not valid; choose one of: debug, info, warning, error, critical")


def test_to_toml_refuses_none_where_the_default_is_not_none():
    with pytest.raises(ConfigError) as e:
        FitConfig(loggers=None).to_toml()
    assert str(e.value) == ("loggers=None cannot be written as TOML (it has no null; reading it back would give the "
                            "default 'auto'): write JSON or YAML instead")


def test_to_dict_names_logger_instances_by_class():
    from lightlike.loggers import CSVLogger

    assert FitConfig(loggers=[CSVLogger("unused"), "jsonl"]).to_dict()["loggers"] == ["CSVLogger", "jsonl"]
    assert FitConfig(loggers=("csv",)).to_dict()["loggers"] == ["csv"]


def test_toml_values_exact():
    assert toml_value(True) == "true" and toml_value(False) == "false"
    assert toml_value([1, True, "a"]) == '[1, true, "a"]'
    assert toml_value("\U0001F600é") == '"\U0001F600é"'  # not a \ud83d surrogate escape (not TOML)
    text = FitConfig(compile=True, output_dir="r\U0001F600").to_toml()
    assert "compile = true\n" in text
    from lightlike.utils import toml
    assert FitConfig.from_dict(toml.loads(text)) == FitConfig(compile=True, output_dir="r\U0001F600")


def test_other_names_exact_hints():
    assert other_name_hint("lr") == "did you mean 'learning_rate'?"
    assert other_name_hint("lr", flag=True) == "did you mean '--learning_rate'?"
    assert other_name_hint("fp16", flag=True) == "did you mean --precision 16-mixed?"
    assert other_name_hint("fp16") == "did you mean precision='16-mixed'?"
    assert other_name_hint("num_nodes") == ("not a lightlike setting: the launcher sets the nodes: torchrun --nnodes N, "
                                            "or sbatch --nodes N (strategies/ has recipes)")
    assert other_name_hint("eval_strategy", flag=True) == "did you mean --eval_every or --eval_on_epoch_end?"
    assert other_name_hint("max_stepz") is None


def test_check_keys_hints():
    with pytest.raises(ConfigError) as e:
        FitConfig(lr=1.0)
    assert str(e.value) == "unknown config key(s): 'lr' (did you mean 'learning_rate'?)"
    with pytest.raises(ConfigError) as e:
        check_keys({"max_step": 1, "zzzzzz": 2})
    assert str(e.value) == "unknown config key(s): 'max_step' (did you mean 'max_steps', 'min_steps', 'max_epochs'?); 'zzzzzz'"


def test_a_path_output_dir_becomes_a_string():
    c = FitConfig(output_dir=Path("a") / "b")
    assert c.output_dir == "a/b" and type(c.output_dir) is str


def test_replace_checks_keys():
    with pytest.raises(ConfigError, match=r"^unknown config key\(s\): 'lr' \(did you mean 'learning_rate'\?\)$"):
        FitConfig().replace(lr=1.0)
    assert FitConfig().replace(batch_size=3).batch_size == 3


@pytest.mark.parametrize(("kw", "want"), [
    (dict(batch_size="true"), "batch_size='true' (str) is not valid: batch_size takes an int"),
    (dict(batch_size="4"), "batch_size='4' (str) is not valid: batch_size takes an int; write batch_size=4, not the string '4'"),
    (dict(compile=" True "), "compile=' True ' (str) is not valid: compile takes True or False; write compile=True, not the string ' True '"),
    (dict(batch_size=None), "batch_size=None (NoneType) is not valid: batch_size takes an int; None is not accepted here: leave batch_size out for its default (8)"),
    (dict(max_steps=5.0), "max_steps=5.0 (float) is not valid: max_steps takes an int or None; write max_steps=5"),
    (dict(batch_size=True), "batch_size=True (bool) is not valid: batch_size takes an int; True is a bool, not a number"),
])
def test_type_errors_exact(kw, want):
    assert config_error(**kw) == want


def test_ints_are_numbers_for_float_fields():
    c = FitConfig(learning_rate=1, max_grad_norm=2)
    assert c.learning_rate == 1 and c.max_grad_norm == 2


@pytest.mark.parametrize(("kw", "ok"), [
    (dict(save_strategy="steps", save_every=2, eval_every=4), True),
    (dict(save_strategy="steps", save_every=4, eval_every=2), True),  # each better evaluation is saved too
    (dict(save_strategy="steps", save_every=2, eval_on_epoch_end=True), True),
    (dict(save_strategy="epoch", eval_on_epoch_end=True), True),
    (dict(save_strategy="epoch", eval_on_epoch_end=True, eval_every=5), True),
    (dict(save_strategy="epoch", eval_every=5), True),
    (dict(save_strategy="no", eval_every=5), "load_best_at_end=True but save_strategy='no' saves no checkpoint"),
])
def test_load_best_at_end_combinations(kw, ok):
    """A refused combination is refused for the fields it names (ok: the error's start)."""
    kw = dict(load_best_at_end=True, metric_for_best="val/loss", **kw)
    if ok is True:
        FitConfig(**kw)
    else:
        with pytest.raises(ConfigError, match=re.escape(ok)):
            FitConfig(**kw)


# -- cli_args.py ------------------------------------------------------------------------------
from typing import Literal  # noqa: E402

from lightlike.cli_args import (  # noqa: E402
    REQUIRED,
    Option,
    convert,
    dump_config,
    kinds_of,
    literal_choices,
    model_options,
    normalise_argv,
    read_config_file,
)


@pytest.mark.parametrize(("raw", "kinds", "default", "want"), [
    ("none", {"str"}, "x", "none"),
    ("null", {"str", "none"}, None, None),
    ("3", {"float"}, 1.0, 3.0),
    ("3", {"int", "float"}, 1, 3),
    (" [1, 2]", {"list"}, (), [1, 2]),
    ("SIGTERM,,SIGUSR1,", {"list"}, (), ["SIGTERM", "SIGUSR1"]),
    ("64", {"any"}, "abc", "64"),
    ("64", {"any"}, None, 64),
    ("On", {"bool"}, False, True),
])
def test_convert_exact(raw, kinds, default, want):
    got = convert(raw, frozenset(kinds), default)
    assert got == want and type(got) is type(want)


def test_kinds_of_exact():

    assert kinds_of("Optional[int]") == {"int", "none"}
    assert kinds_of("Path") == {"str"}
    assert kinds_of(Literal["a", "b"]) == {"str"}
    assert kinds_of(bool) == {"bool"}
    assert kinds_of(REQUIRED, True) == {"bool"}
    assert kinds_of(REQUIRED, None) == {"any", "none"}
    assert literal_choices(Literal[1, 2] | None) == (1, 2)
    assert literal_choices(Literal[1] | str) is None


def test_model_options_skip_star_args_and_read_indented_docs():
    class M:
        def __init__(self, width: int = 3, *args, **kwargs):
            """Build it.

            width: a prose line at the margin, not the Args entry.
            Args:
                width: hidden units.
            """

    opts, var_kw = model_options(M)
    assert [(o.key, o.help) for o in opts] == [("model.width", "hidden units.")] and var_kw is True


def test_normalise_argv_bare_bools_and_optional_values():
    opts = {"compile": Option("compile", frozenset({"bool"}), False)}
    resume = {"resume": lambda t: t.lower() in ("true", "auto") or ("/" in t and ":" not in t)}
    assert normalise_argv(["--compile", "--resume", "--config=conf/run.toml"], opts, resume) == \
        ["--compile=true", "--resume=true", "--config=conf/run.toml"]
    assert normalise_argv(["--max-steps", "3", "--compile", "no"], opts, {}) == ["--max_steps", "3", "--compile", "no"]


def test_bool_or_int_option_takes_only_numbers_next():
    o = Option("model.x", frozenset({"bool", "int"}), False)
    assert o.takes_next("3") and o.takes_next("off") and not o.takes_next("foo")
    s = Option("model.pad", frozenset({"bool", "str"}), False)
    assert s.takes_next("longest") and not s.takes_next("examples/m.py:Cls")
    lit = Option("model.pad", frozenset({"bool", "str"}), False, choices=(True, "longest"))
    assert lit.takes_next("longest") and not lit.takes_next("shortest")


def test_empty_yaml_and_upper_case_suffix(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "e.yaml").write_text("")
    assert read_config_file(tmp_path / "e.yaml") == {}
    (tmp_path / "u.TOML").write_text("max_steps = 2\n")
    assert read_config_file(tmp_path / "u.TOML") == {"max_steps": 2}


def test_dump_config_toml_refuses_none_over_a_default():
    assert dump_config({}, {"b": None}, "toml", None, {"model.b": None}) == "\n[model]\n# b = None (unset)\n"
    with pytest.raises(ConfigError) as e:
        dump_config({}, {"b": None}, "toml", None, {"model.b": 0.5})
    assert str(e.value) == ("model.b=None cannot be written as TOML (it has no null; reading it back would give the "
                            "default 0.5): use --format json or yaml")


def test_call_with_known():
    from lightlike.cli_targets import call_with_known

    assert call_with_known(lambda **kw: kw, {"config": 1, "module": 2}) == {"config": 1, "module": 2}
    assert call_with_known(lambda config: config, {"config": 1, "module": 2}) == 1


# -- cli.py, in process -----------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2] / "pristine"
import lightlike as _ll  # noqa: E402

ROOT = Path(_ll.__file__).resolve().parents[1]
TARGET = f"{ROOT / 'examples' / 'cli_module.py'}:Classifier"


def _parse(cmd, *argv):
    from lightlike.cli import _parse as p

    return p(cmd, list(argv))


def test_resume_value_words():
    from lightlike.cli import _resume_value

    assert _resume_value("AUTO") == "auto" and _resume_value("Yes") is True and _resume_value("0") is False
    assert _resume_value("runs/x") == "runs/x"


def test_resume_before_the_target_does_not_take_it():
    r = _parse("fit", "--resume", TARGET, "--max_steps", "1")
    assert r["args"]["cli_resume"] is True and r["cls"].__name__ == "Classifier"


def test_precedence_and_file_naming(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text("max_steps = 5\nbatch_size = 4\n[model]\nwidth = 7\n")
    r = _parse("config", TARGET, "--config", str(f), "--max_steps", "6", "--model.width", "9")
    assert (r["config"].max_steps, r["config"].batch_size, r["model"]["width"]) == (6, 4, 9)
    f.write_text("max_steps = 5\nbatch_size = 0\n")
    with pytest.raises(ConfigError) as e:
        _parse("config", TARGET, "--config", str(f))
    assert str(e.value) == f"{f}: batch_size must be a positive int, got 0"
    with pytest.raises(ConfigError) as e:  # the flag set it too: the flag's value is the one refused
        _parse("config", TARGET, "--config", str(f), "--batch_size", "0")
    assert str(e.value) == "batch_size must be a positive int, got 0"


def test_config_needs_no_stopping_criterion_and_fit_does():
    assert _parse("config", TARGET)["config"].max_steps is None
    with pytest.raises(ConfigError, match="^no stopping criterion: set max_steps=N or max_epochs=N$"):
        _parse("fit", TARGET)


def test_export_folder_hparams_fill_known_arguments_only(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "hparams.json").write_text(json.dumps({"width": 5, "unknown": 1}))
    r = _parse("validate", TARGET, "--checkpoint", str(tmp_path))
    assert r["checkpoint"] == tmp_path
    assert r["model"] == {"in_features": 16, "classes": 4, "width": 5, "dropout": 0.0, "train_items": 1024,
                          "val_items": 256}


def test_a_required_constructor_argument_missing(tmp_path):
    (tmp_path / "req.py").write_text(
        "import lightlike as ll\nclass R(ll.TaskModule):\n    def __init__(self, depth: int, width: int = 2):\n"
        "        super().__init__()\n")
    with pytest.raises(ConfigError) as e:
        _parse("config", f"{tmp_path / 'req.py'}:R")
    assert str(e.value) == ("R needs constructor argument(s) depth: pass --model.depth VALUE or set it in the "
                            "config file's [model] table")
    assert _parse("config", f"{tmp_path / 'req.py'}:R", "--model.depth", "3")["model"] == {"depth": 3, "width": 2}


def test_a_file_with_two_modules_needs_the_name(tmp_path):
    from lightlike.cli_targets import load_target
    from lightlike.module import TaskModule

    (tmp_path / "two.py").write_text("import lightlike as ll\nclass B(ll.TaskModule): pass\nclass A(ll.TaskModule): pass\n")
    with pytest.raises(ConfigError) as e:
        load_target(str(tmp_path / "two.py"), "module", TaskModule)
    assert str(e.value) == f"module {str(tmp_path / 'two.py')!r}: name one as {tmp_path / 'two.py'}:NAME (defined there: A, B)"


def test_data_sources(tmp_path):
    from lightlike.cli import _data_source
    from lightlike.errors import DataError

    (tmp_path / "dfac.py").write_text(
        "def four():\n    return 1, 2, 3, 4\n"
        "def odd():\n    return {'train': 1, 'foo': 2}\n")
    get, _ = _data_source(f"{tmp_path / 'dfac.py'}:four", None, None, "train")
    assert [get(r) for r in ("train", "val", "test", "predict")] == [1, 2, 3, 4]
    with pytest.raises(DataError) as e:
        _data_source(f"{tmp_path / 'dfac.py'}:odd", None, None, "train")
    assert str(e.value) == f"--data {tmp_path / 'dfac.py'}:odd: unknown key 'foo'; use train, val, test, predict"


def test_eval_data_note_only_on_a_fallback(capsys):
    from lightlike.cli import _eval_data

    class Mod:
        def test_data(self):
            return "T"

        def val_data(self):
            return "V"

    assert _eval_data("test", None, Mod(), None) == "T"
    assert capsys.readouterr().err == ""
    assert _eval_data("validate", None, Mod(), None) == "V"
    assert _eval_data("predict", None, Mod(), None) == "T"
    assert capsys.readouterr().err == "lightlike predict: note: no predict data, using the test data\n"


def test_main_without_arguments_is_a_usage_error(capsys):
    from lightlike.cli import main

    assert main([]) == 2 and "usage: lightlike" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_record_hparams_keeps_the_module_s_own():
    from lightlike.cli import _record_hparams

    class M:
        def __init__(self, h):
            self.hparams = h

    own, empty = M({"a": 1}), M({})
    _record_hparams(own, {"b": 2})
    _record_hparams(empty, {"b": 2})
    assert own.hparams == {"a": 1} and empty.hparams == {"b": 2}


def test_help_with_a_bad_target_notes_it(capsys):
    from lightlike.cli import main

    with pytest.raises(SystemExit) as e:
        main(["fit", "no_such_file.py:X", "--help"])
    assert e.value.code == 0
    out, err = capsys.readouterr()
    assert err == "lightlike fit: note: module 'no_such_file.py:X': no such file 'no_such_file.py'\n"
    assert "--max_steps" in out


def test_plain_turns_tensors_into_lists():
    import torch

    from lightlike.cli import _plain

    assert _plain({"p": torch.tensor([1, 2]), 3: (torch.tensor(0.5),)}) == {"p": [1, 2], "3": [0.5]}


def test_config_comments(capsys):
    from lightlike.cli import main

    assert main(["config", TARGET, "--comments"]) == 0
    out = capsys.readouterr().out
    assert "# Directory for checkpoints, logs and metrics files.\noutput_dir = \"runs/lightlike\"\n" in out
    assert "# hidden units.\nwidth = 32\n" in out


def test_a_checkpoint_error_offering_resume_names_the_flag(capsys, tmp_path):
    """A CheckpointError that offers resume='auto' (--resume on an output_dir without a checkpoint,
    driven through the real command) names the flag, ``--resume auto``, after its message."""
    from lightlike import cli

    out = tmp_path / "empty"
    assert cli.main(["fit", TARGET, "--max_steps", "2", "--resume", "--output_dir", str(out), "--loggers", "[]",
                     "--model_summary", "false", "--model.train_items", "32", "--model.val_items", "16"]) == 2
    assert capsys.readouterr().err == (
        f"lightlike fit: error: resume=True but {str(out)!r} holds no valid checkpoint to resume from (weights-only "
        "ones, from save_only_model, cannot resume a run); start without resume, pass resume='auto' (resume if there "
        "is a checkpoint, else start fresh), or pass resume='path/to/checkpoint-N' (on the command line: --resume "
        "auto, or another --output_dir)\n")
    assert not out.exists()


def test_load_weights_of_an_export_folder_reads_it_directly(tmp_path):
    from lightlike.cli import _load_weights

    (tmp_path / "model.safetensors").write_bytes(b"")
    seen = []

    class M:
        def load_weights(self, path):
            seen.append(path)

    _load_weights(M(), tmp_path, FitConfig())
    assert seen == [tmp_path]


def test_top_help_type_names():
    from lightlike.cli import _top_parser

    text = " ".join(_top_parser().format_help().split())
    assert "max_steps (int | None, default None)" in text and "fused (bool | None, default None)" in text


# -- defects the round found ---------------------------------------------------------------------
def test_sequence_and_mapping_arguments_are_read_as_lists_and_dicts(tmp_path):
    (tmp_path / "seqmod.py").write_text(
        "from collections.abc import Mapping, Sequence\nimport typing\nimport lightlike as ll\n"
        "class S(ll.TaskModule):\n"
        "    def __init__(self, names: Sequence[str] = ('a',), sizes: typing.Sequence[int] = (1,),\n"
        "                 opts: Mapping[str, int] | None = None, raw: bytes = b''):\n"
        "        super().__init__()\n")
    from lightlike.cli_args import kinds_of
    assert kinds_of(typing.Sequence[int]) == {"list"} and kinds_of(bytes) == {"any"}
    r = _parse("config", f"{tmp_path / 'seqmod.py'}:S", "--model.names", "x,y", "--model.sizes", "1,2",
               "--model.opts", '{"a": 1}')
    assert r["model"] == {"names": ["x", "y"], "sizes": [1, 2], "opts": {"a": 1}, "raw": b""}


@pytest.mark.parametrize("fmt", ["toml", "yaml", "json"])
def test_config_writes_a_path_default_as_its_text(fmt, tmp_path, capsys):
    from lightlike.cli import main
    from lightlike.cli_args import read_config_file
    (tmp_path / "pathmod.py").write_text(
        "from pathlib import Path\nimport lightlike as ll\n"
        "class P(ll.TaskModule):\n"
        "    def __init__(self, data_dir: Path = Path('data') / 'x', dirs: list[Path] = (Path('a'),)):\n"
        "        super().__init__()\n")
    main(["config", f"{tmp_path / 'pathmod.py'}:P", "--format", fmt])
    (tmp_path / f"c.{fmt}").write_text(capsys.readouterr().out)
    assert read_config_file(tmp_path / f"c.{fmt}")["model"] == {"data_dir": "data/x", "dirs": ["a"]}


def test_toml_round_trips_a_delete_character():
    from lightlike.utils import toml
    config = FitConfig(output_dir="runs/a\x7fb")
    assert FitConfig.from_toml(config.to_toml()).output_dir == "runs/a\x7fb"
    table = {"k\x7f": "v\x7f"}
    assert toml.loads(f"x = {toml_value(table)}")["x"] == table


def test_none_for_a_factory_default_names_the_default():
    assert config_error(preemption_signals=None).endswith(
        "None is not accepted here: leave preemption_signals out for its default (['SIGTERM', 'SIGUSR1'])")
