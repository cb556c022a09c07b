"""Property-based fuzzing of what `accel plan`, `accel estimate-memory`, `accel plot` and `accel merge-weights` read:
every flag of their parsers, model configs, safetensors headers and indexes, calibration files, metrics files (jsonl,
csv, TensorBoard event files) and damaged checkpoints. The rule (docs/troubleshooting.md): each input either
works (exit 0) or is refused in ONE line on stderr with exit code 2 and no traceback.

The flags are read from `accel`'s parsers (accel/cli/main.py `build_parser`), so a new one is fuzzed without a change here.
Models are tiny transformers configs built on the meta device; examples are derandomized (the same ones on every run)
and few enough that the file runs in well under a minute. Also here: a tensor-parallel plan with a bad style is
refused before launch, and torchrun's argument errors are one line with exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from cli_fuzz import (  # tests/cli_fuzz.py, the shared harness (tests/ is on the path, as for conftest)
    FUZZ,
    SCALE,
    EDGE_NUMBERS,
    EDGE_TEXTS,
    bad_encodings,
    dump_text,
    flag_values,
    nested_text,
    wrong_values,
)
from cli_fuzz import run_accel as run_accel_quietly


if os.environ.get("ACCEL_FUZZ_SHRINK") == "0":  # by hand: report the first failing example as found, unshrunk
    FUZZ = settings(FUZZ, phases=[Phase.explicit, Phase.generate])


def fuzz(examples: int) -> settings:
    return settings(FUZZ, max_examples=max(1, round(examples * SCALE)))


COMMANDS = ("plan", "estimate-memory", "plot", "merge-weights")
# switches left out of the flag fuzz: --calibrate measures this machine for a minute
# (tests/unit/planning/test_measure.py runs it), --remove_checkpoint_dir deletes the fixture every other example merges
STARTS_WORK = ("--calibrate", "--remove_checkpoint_dir", "--remove-checkpoint-dir")
TINY_CONFIG = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 64,
               "tie_word_embeddings": False}
CALIBRATION = {"version": 1, "time": 1.0, "device": "cpu", "matmul_tflops": {"fp32": 0.1}, "flops": 1e11,
               "intra_bandwidth": 2e9, "tokens_half": 10.0, "width_half": 20.0, "memory_bandwidth": 1e10,
               "op_overhead": 1e-5, "run_ahead": False, "intra_latency": 1e-4, "gather_factor": 0.5,
               "scatter_factor": 0.4, "collectives": {"world": 2, "all_reduce": [[16384, 1e-4], [1048576, 1e-3]],
                                                     "all_gather": [[16384, 1e-4], [1048576, 2e-3]],
                                                     "reduce_scatter": [[16384, 1e-4], [1048576, 2e-3]]},
               "sync_fixed": 1e-3, "sync_slowdown": 1.2, "overlap": 0.4, "fsdp_call": 1e-3, "tp_call": 2e-3,
               "collective_backend": "gloo"}
GOOD_LINES = ['{"step": 0, "time": 1.0, "values": {"loss": 2.0, "lr": 0.1}}',
              '{"step": 1, "time": 2.0, "values": {"loss": 1.5, "eval": {"acc": 0.5}}}']


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A folder holding a tiny model config, a safetensors checkpoint, a run folder of metrics and a DCP checkpoint;
    the current directory while the module's tests run, with no stored calibration read (XDG_CACHE_HOME inside)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("fuzz_tools")
    (root / "cfg.json").write_text(json.dumps(TINY_CONFIG))
    torch.manual_seed(0)
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4), "model.layers.1.mlp.up_proj.weight":
               torch.zeros(8, 4, dtype=torch.bfloat16), "lm_head.weight": torch.zeros(16, 4)},
              root / "model.safetensors", metadata={"format": "pt"})
    (root / "runs" / "run-001").mkdir(parents=True)
    (root / "runs" / "run-001" / "metrics.jsonl").write_text("\n".join(GOOD_LINES) + "\n")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "ckpt"), no_dist=True)
    saved, old_cwd = dict(os.environ), os.getcwd()
    _accel_checkpoint(root / "accel_ckpt", model)
    _event_file(root / "tb")
    os.environ.clear()
    os.environ.update(saved)
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    os.chdir(root)
    try:
        for argv in (["plan", "cfg.json"], ["estimate-memory", "model.safetensors"], ["plot", "runs", "-o", "c.svg"],
                     ["merge-weights", "ckpt", "merged"]):  # each works, and its imports are done before fuzzing
            outcome = run_accel(argv)
            assert outcome.code == 0, f"accel {' '.join(argv)}: {outcome}"
        yield root
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(saved)


def run_accel(argv):
    """The harness's `accel`, with the warnings a fresh process would print on its stderr."""
    return run_accel_quietly(argv, show_warnings=True)


def _accel_checkpoint(folder: Path, model) -> None:
    """accel's own save_state folder (manifest, state/ shards, rng/), as one CPU process writes it."""
    import torch

    from accel import Accelerator

    accelerator = Accelerator(cpu=True)
    prepared, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.save_state(str(folder))


def _event_file(folder: Path) -> None:
    """A TensorBoard event file with a few scalars (its writer: tensorboard's own)."""
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.compat.proto import event_pb2, summary_pb2

    writer = EventFileWriter(str(folder))
    for step in range(4):
        value = summary_pb2.Summary.Value(tag="loss", simple_value=1.0 / (step + 1))
        writer.add_event(event_pb2.Event(step=step, wall_time=1.0 + step, summary=summary_pb2.Summary(value=[value])))
    writer.close()


def check(outcome, argv, inputs: str = "") -> None:
    shown = f"accel {' '.join(map(str, argv))[:300]}\n{inputs[:800]}\n{outcome}"
    assert outcome.follows_the_rule(), shown


@functools.cache
def _parsers() -> dict[str, argparse.ArgumentParser]:
    from accel.cli.main import _subparsers, build_parser

    return {name: parser for name, parser in _subparsers(build_parser()).items() if name in COMMANDS}


def _base(place: Path, command: str) -> list[str]:
    """A command line that works, its inputs named by absolute paths (the flag fuzz runs in a scratch folder)."""
    return {"plan": ["plan", str(place / "cfg.json")], "estimate-memory": ["estimate-memory", str(place / "cfg.json")],
            "plot": ["plot", str(place / "runs"), "-o", "out.html"],
            "merge-weights": ["merge-weights", str(place / "ckpt"), "merged"]}[command]


def _run_in_scratch(place: Path, argv: list[str]):
    """`accel ARGV` in an empty folder, emptied again after: what one flag value wrote (`--write null`, `-o x`)
    is never read by another (`--measure null` would run it as a script)."""
    scratch = place / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    os.chdir(scratch)
    try:
        return run_accel(argv)
    finally:
        os.chdir(place)
        shutil.rmtree(scratch, ignore_errors=True)


def _actions(command: str) -> list[argparse.Action]:
    return [a for a in _parsers()[command]._actions if not isinstance(a, (argparse._HelpAction,
                                                                          argparse._VersionAction))]


# ---------------------------------------------------------------------------------------------------------------
# (a) every flag and positional of the four commands, given generated values
# ---------------------------------------------------------------------------------------------------------------

WRITES = ("output_path", "write", "output")  # flags naming what a command writes


def _contained(action: argparse.Action, value: str) -> str:
    """A value for a flag that names what the command writes, kept inside the scratch folder: an absolute path or
    one climbing out with `..` is flattened into a name there (the fuzz must not write to / or beside the repo)."""
    if action.dest in WRITES and (value.startswith(("/", "~")) or ".." in Path(value).parts):
        return "inside_" + value.replace("/", "_")
    return value


def _argv_with(place: Path, command: str, action: argparse.Action, value: str) -> list[str]:
    value = _contained(action, value)
    base = _base(place, command)
    if not action.option_strings:  # a positional: its place in the base command line
        positionals = [a for a in _actions(command) if not a.option_strings]
        base[1 + positionals.index(action)] = value
        return base
    return [*base, action.option_strings[0], value]


@fuzz(12)
@given(data=st.data())
def test_every_flag_with_generated_values_is_one_line(place, data):
    """Each example gives each value-taking flag and positional of each command a generated value, one at a time,
    with some of the command's switches."""
    for command in COMMANDS:
        switches = [a.option_strings[0] for a in _actions(command)
                    if a.option_strings and a.nargs == 0 and a.option_strings[0] not in STARTS_WORK]
        for action in _actions(command):
            if action.option_strings and action.nargs == 0:
                continue
            value = data.draw(flag_values(), label=f"{command} {action.dest}")
            extra = data.draw(st.lists(st.sampled_from(switches), max_size=2, unique=True), label="switches") \
                if switches else []
            argv = _argv_with(place, command, action, value) + extra
            check(_run_in_scratch(place, argv), argv)


EDGE_VALUES = list(dict.fromkeys([*EDGE_TEXTS, *(str(n) for n in EDGE_NUMBERS), "a" * 300, "/", "..", "-"]))


def test_every_flag_with_every_edge_value_is_one_line(place):
    """Every value-taking flag and positional of each command, with every edge value of the harness (not drawn at
    random: each one, every run)."""
    for command in COMMANDS:
        for action in _actions(command):
            if action.option_strings and action.nargs == 0:
                continue
            for value in EDGE_VALUES:
                argv = _argv_with(place, command, action, value)
                check(_run_in_scratch(place, argv), argv)


def test_every_flag_is_fuzzed():
    """The fuzz above reads the flags from the parsers: each command has its value flags there."""
    for command, wanted in {"plan": {"flops", "device_memory", "batch_size", "calibration", "measure"},
                            "estimate-memory": {"dtypes", "tp_size", "seq_len"},
                            "plot": {"smoothing", "metrics", "output", "run_dirs"},
                            "merge-weights": {"checkpoint_directory", "output_path"}}.items():
        assert wanted <= {a.dest for a in _actions(command) if a.nargs != 0}, command


@fuzz(25)
@given(flag=st.sampled_from(["--flops", "--device_memory", "--host_memory", "--intra_bandwidth",
                             "--inter_bandwidth", "--batch_size", "--seq_len", "--num_processes", "--num_machines",
                             "--top", "--steps"]),
       value=st.one_of(st.sampled_from([str(n) for n in EDGE_NUMBERS] + ["1e400", "-0", "80GB", "0GB", "1e30TB"]),
                       st.floats().map(repr), st.integers().map(str)))
def test_plan_numbers_are_finite_and_in_range(place, flag, value):
    """A number flag of `accel plan` either plans with a finite value (no nan or infinity in the plan) or is one
    line naming the flag."""
    argv = ["plan", "cfg.json", flag, value, "--json"]
    outcome = run_accel(argv)
    check(outcome, argv)
    if outcome.code == 0:
        json.loads(outcome.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the plan: {argv}"))
    else:
        assert flag in outcome.stderr, outcome


# ---------------------------------------------------------------------------------------------------------------
# (b) model configs: wrong types, edge numbers, deep nesting, bad encodings, the wrong shape
# ---------------------------------------------------------------------------------------------------------------

CONFIG_KEYS = [*TINY_CONFIG, "text_config", "rope_scaling", "hidden_act", "head_dim", "torch_dtype", "architectures",
               "rms_norm_eps", "attention_bias", "pad_token_id", "__class__", "to_dict", ""]


@st.composite
def odd_models(draw) -> bytes:
    """A config transformers builds, of odd sizes: one head, a vocabulary of one, a single layer, ties, several
    model types (what the planner then meets: tiny widths, empty-looking shapes)."""
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    head_dim = draw(st.sampled_from([1, 2, 8]))
    hidden, layers, vocab = heads * head_dim, draw(st.integers(1, 6)), draw(st.sampled_from([1, 2, 7, 64]))
    model_type = draw(st.sampled_from(["llama", "gpt2", "mistral", "qwen2"]))
    if model_type == "gpt2":
        doc = {"model_type": "gpt2", "n_embd": hidden, "n_head": heads, "n_layer": layers, "vocab_size": vocab,
               "n_positions": draw(st.sampled_from([1, 16, 64]))}
    else:
        doc = {"model_type": model_type, "hidden_size": hidden, "num_attention_heads": heads,
               "num_key_value_heads": kv, "num_hidden_layers": layers, "vocab_size": vocab,
               "intermediate_size": draw(st.sampled_from([1, 3, 32])), "max_position_embeddings": 64,
               "tie_word_embeddings": draw(st.booleans())}
    return json.dumps(doc).encode()


def config_documents() -> st.SearchStrategy:
    """A config.json's bytes: one key given a wrong value or an edge number, the whole document wrong, deep
    nesting, the good document encoded badly, or a config of odd but buildable sizes."""
    def one_key(pair):
        key, value = pair
        return dump_text({**TINY_CONFIG, key: value}).encode()

    good = json.dumps(TINY_CONFIG)
    return st.one_of(
        odd_models(), odd_models(),
        st.tuples(st.sampled_from(CONFIG_KEYS), st.sampled_from([*EDGE_NUMBERS, 1, 2, 3, 8, 1024, 1025, "8", None,
                                                                  True])).map(one_key),
        st.tuples(st.sampled_from(CONFIG_KEYS), wrong_values()).map(one_key),
        st.tuples(st.sampled_from(CONFIG_KEYS), st.integers(min_value=-2, max_value=2 ** 70)).map(one_key),
        wrong_values().map(lambda v: dump_text(v).encode()),
        st.integers(min_value=100, max_value=50_000).map(lambda d: nested_text(d, "{", "model_type").encode()),
        bad_encodings(good),
        st.binary(max_size=64))


@fuzz(80)
@given(doc=config_documents(), command=st.sampled_from(["plan", "estimate-memory", "estimate-activations"]),
       folder=st.booleans())
def test_a_bad_model_config_is_one_line(place, doc, command, folder):
    target = place / "model_dir" if folder else place / "fuzzed.json"
    if folder:
        target.mkdir(exist_ok=True)
        (target / "config.json").write_bytes(doc)
    else:
        target.write_bytes(doc)
    argv = {"plan": ["plan", target], "estimate-memory": ["estimate-memory", target],
            "estimate-activations": ["estimate-memory", target, "--batch_size", "1", "--seq_len", "4"]}[command]
    check(run_accel(argv), argv, doc[:800].decode("utf-8", "replace"))


# ---------------------------------------------------------------------------------------------------------------
# (c) safetensors files with fuzzed headers, and sharded indexes
# ---------------------------------------------------------------------------------------------------------------

def _good_safetensors(place) -> tuple[dict, bytes]:
    raw = (place / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _pack(header_text: bytes, data: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_text) if length is None else length) + header_text + data


def safetensors_files(place) -> st.SearchStrategy:
    header, data = _good_safetensors(place)
    names = [n for n in header if n != "__metadata__"]

    def whole(value):
        return _pack(dump_text(value).encode(), data)

    def entry(args):
        name, value = args
        return _pack(dump_text({**header, name: value}).encode(), data)

    def field(args):
        name, key, value = args
        return _pack(dump_text({**header, name: {**header[name], key: value}}).encode(), data)

    def length(args):
        text, n = dump_text(header).encode(), args
        return _pack(text, data, n)

    good = dump_text(header).encode()
    return st.one_of(
        odd_safetensors(), odd_safetensors(),
        wrong_values().map(whole),
        st.tuples(st.sampled_from([*names, "__metadata__"]), wrong_values()).map(entry),
        st.tuples(st.sampled_from(names), st.sampled_from(["dtype", "shape", "data_offsets"]),
                  st.one_of(wrong_values(), st.lists(st.integers(min_value=-5, max_value=2 ** 64), max_size=4),
                            st.sampled_from(["F4", "F6_E2M3", "C64", "U64", "X9", "f32"]))).map(field),
        st.sampled_from([0, 1, 7, len(good) - 1, len(good) + 1, 2 ** 63, 2 ** 64 - 1, 100_000_001]).map(length),
        st.integers(min_value=0, max_value=len(good) + 8 + len(data)).map(
            lambda cut: _pack(good, data)[:cut]),
        bad_encodings(good.decode()).map(lambda text: _pack(text, data)),
        st.binary(max_size=64))


@st.composite
def odd_safetensors(draw) -> bytes:
    """A well-formed safetensors file of odd tensors: empty and 0-d ones, many dimensions, every dtype, names of
    blocks, embeddings, heads or anything."""
    from accel.planning.inputs import SAFETENSORS_BITS

    names = st.one_of(st.sampled_from(["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn."
                                       "q_proj.weight", "model.layers.1.mlp.down_proj.weight", "layers.0.w",
                                       "model.layers.0.c_attn.weight", "h.3.attn.c_attn.bias"]),
                      st.text(max_size=12))
    tensors = draw(st.dictionaries(names.filter(lambda n: n != "__metadata__"), st.tuples(
        st.sampled_from(sorted(SAFETENSORS_BITS)), st.lists(st.integers(0, 6), max_size=5)), max_size=5))
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = -(-SAFETENSORS_BITS[dtype] * math.prod(shape) // 8)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return _pack(json.dumps(header).encode(), bytes(offset))


@fuzz(80)
@given(data=st.data(), command=st.sampled_from(["plan", "estimate-memory"]))
def test_a_damaged_safetensors_file_is_one_line(place, data, command):
    raw = data.draw(safetensors_files(place), label="file")
    target = place / "fuzzed.safetensors"
    target.write_bytes(raw)
    argv = [command, target]
    check(run_accel(argv), argv, repr(raw[:400]))


def index_documents() -> st.SearchStrategy:
    files = st.sampled_from(["model.safetensors", "missing.safetensors", "runs", "", "../model.safetensors",
                             "a\x00b", "x" * 300])
    return st.one_of(
        wrong_values().map(lambda v: dump_text(v).encode()),
        wrong_values().map(lambda v: dump_text({"weight_map": v}).encode()),
        st.dictionaries(st.text(max_size=10), st.one_of(files, wrong_values()), max_size=3).map(
            lambda m: dump_text({"metadata": {}, "weight_map": m}).encode()),
        bad_encodings(json.dumps({"weight_map": {"lm_head.weight": "model.safetensors"}})),
        st.binary(max_size=64))


@fuzz(40)
@given(doc=index_documents(), command=st.sampled_from(["plan", "estimate-memory"]), folder=st.booleans())
def test_a_damaged_safetensors_index_is_one_line(place, doc, command, folder):
    if folder:
        target = place / "sharded"
        target.mkdir(exist_ok=True)
        shutil.copy(place / "model.safetensors", target / "model.safetensors")
        (target / "model.safetensors.index.json").write_bytes(doc)
    else:
        target = place / "model.safetensors.index.json"
        target.write_bytes(doc)
    argv = [command, target]
    check(run_accel(argv), argv, doc[:800].decode("utf-8", "replace"))


# ---------------------------------------------------------------------------------------------------------------
# (d) `accel plan`'s calibration file
# ---------------------------------------------------------------------------------------------------------------

def calibration_documents() -> st.SearchStrategy:
    keys = [*CALIBRATION, "collectives.all_reduce", "collectives.all_gather"]

    def one_key(pair):
        key, value = pair
        doc = json.loads(json.dumps(CALIBRATION))
        if key.startswith("collectives."):
            doc["collectives"][key.split(".", 1)[1]] = value
        else:
            doc[key] = value
        return dump_text(doc).encode()

    def dropped(key):
        return json.dumps({k: v for k, v in CALIBRATION.items() if k != key}).encode()

    return st.one_of(
        st.tuples(st.sampled_from(keys), wrong_values()).map(one_key),
        st.tuples(st.sampled_from(keys), st.sampled_from(EDGE_NUMBERS)).map(one_key),
        st.tuples(st.sampled_from(keys[-2:]), st.lists(st.lists(st.sampled_from(EDGE_NUMBERS), max_size=3),
                                                       max_size=4)).map(one_key),
        st.sampled_from(list(CALIBRATION)).map(dropped),
        wrong_values().map(lambda v: dump_text(v).encode()),
        bad_encodings(json.dumps(CALIBRATION)),
        st.binary(max_size=64))


@fuzz(60)
@given(doc=calibration_documents(), flops=st.booleans())
def test_a_damaged_calibration_file_is_one_line(place, doc, flops):
    (place / "cal.json").write_bytes(doc)
    argv = ["plan", "cfg.json", "--calibration", "cal.json", "--num_processes", "2", "--json"]
    argv += ["--flops", "100"] if flops else []  # compute figures from the flag, links from the file
    outcome = run_accel(argv)
    check(outcome, argv, doc[:800].decode("utf-8", "replace"))
    if outcome.code == 0:
        json.loads(outcome.stdout, parse_constant=lambda name: pytest.fail(f"{name} in the plan"))


def test_calibration_named_but_missing_is_one_line(place):
    outcome = run_accel(["plan", "cfg.json", "--calibration", "nowhere.json"])
    check(outcome, ["plan"])
    assert outcome.code == 2 and "nowhere.json" in outcome.stderr and "--calibrate" in outcome.stderr


# ---------------------------------------------------------------------------------------------------------------
# (e) `accel plot`'s inputs: metrics.jsonl lines, metrics.csv rows, TensorBoard event files, run folders
# ---------------------------------------------------------------------------------------------------------------

HUGE = ["1e308", "-1e308", "1e400", "9" * 400, "-" + "9" * 400, "NaN", "Infinity", "-Infinity", "5e-324", "0"]


def jsonl_lines() -> st.SearchStrategy:
    def record(args):
        step, values = args
        return dump_text({"step": step, "time": 1.0, "values": values}).encode()

    def raw_value(args):
        step, value = args
        return f'{{"step": {step}, "time": 1, "values": {{"loss": {value}, "x$y^": {value}}}}}'.encode()

    return st.one_of(
        st.sampled_from([line.encode() for line in GOOD_LINES]),
        st.tuples(st.one_of(wrong_values(), st.integers()), st.dictionaries(st.text(max_size=6), wrong_values(),
                                                                             max_size=3)).map(record),
        st.tuples(st.sampled_from(["0", "1", "null", *HUGE]), st.sampled_from(HUGE)).map(raw_value),
        wrong_values().map(lambda v: dump_text(v).encode()),
        st.integers(min_value=100, max_value=5000).map(lambda d: b'{"step": 1, "values": ' + nested_text(
            d, "{").encode() + b"}"),
        bad_encodings(GOOD_LINES[0]),
        st.binary(max_size=40))


def csv_rows() -> st.SearchStrategy:
    field = st.one_of(st.sampled_from(["0", "1", "loss", "", *HUGE, "x" * 200_000]), st.text(max_size=8))
    return st.one_of(st.lists(field, min_size=0, max_size=5).map(lambda row: ",".join(row).encode()),
                     bad_encodings("1,2.0,loss,0.5"), st.binary(max_size=30), st.just(b"1,2,a\x00b,3"))


def _layout(project: Path, odd: str) -> None:
    """An odd entry beside the run folder: what a project folder may hold by accident."""
    if odd == "file named like a run":
        (project / "run-008").write_text("x")
    elif odd == "metrics.jsonl a folder":
        (project / "run-009" / "metrics.jsonl").mkdir(parents=True)
    elif odd == "broken link":
        (project / "run-010").symlink_to(project / "nowhere")
    elif odd == "link loop":
        (project / "run-011").symlink_to(project / "run-011")
    elif odd == "deep folders":
        (project / "a" / "b" / "c" / "d" / "e").mkdir(parents=True)
        (project / "a" / "b" / "c" / "d" / "e" / "metrics.jsonl").write_text(GOOD_LINES[0] + "\n")
    elif odd == "empty metrics":
        (project / "run-012").mkdir()
        (project / "run-012" / "metrics.jsonl").write_bytes(b"")


@fuzz(60)
@given(data=st.data(), kind=st.sampled_from(["jsonl", "jsonl", "csv", "events", "damaged events"]),
       fmt=st.sampled_from(["html", "html", "html", "svg"]), smoothing=st.sampled_from(["0", "0.6", "0.999"]),
       odd=st.sampled_from(["none", "file named like a run", "metrics.jsonl a folder", "broken link", "link loop",
                            "deep folders", "empty metrics"]))
def test_damaged_metrics_are_one_line(place, data, kind, fmt, smoothing, odd):
    run = place / "project" / "run-007"
    if run.parent.exists():
        shutil.rmtree(run.parent)
    run.mkdir(parents=True)
    _layout(run.parent, odd)
    if kind == "jsonl":
        lines = data.draw(st.lists(jsonl_lines(), min_size=1, max_size=4), label="lines")
        raw = b"\n".join(lines) + b"\n"
        (run / "metrics.jsonl").write_bytes(raw)
    elif kind == "csv":
        rows = data.draw(st.lists(csv_rows(), max_size=4), label="rows")
        header = data.draw(st.sampled_from([b"step,time,name,value", b"", b"a,b", b"\xff\xfe"]), label="header")
        raw = b"\n".join([header, *rows]) + b"\n"
        (run / "metrics.csv").write_bytes(raw)
    elif kind == "events":
        raw = data.draw(st.binary(max_size=200), label="event file")
        (run / "events.out.tfevents.1700000000.host.1.0").write_bytes(raw)
    else:
        raw = next((place / "tb").glob("events.out.tfevents.*")).read_bytes()
        at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1), label="at")
        raw = data.draw(st.sampled_from([raw[:at], raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:]]), label="how")
        (run / "events.out.tfevents.1700000000.host.1.0").write_bytes(raw)
    argv = ["plot", run.parent, "-o", f"out.{fmt}", "--smoothing", smoothing]
    check(run_accel(argv), argv, repr(raw[:800]))


# ---------------------------------------------------------------------------------------------------------------
# (f) `accel merge-weights`: damaged checkpoint folders
# ---------------------------------------------------------------------------------------------------------------

@fuzz(40)
@given(data=st.data())
def test_a_damaged_checkpoint_is_one_line(place, data):
    folder = place / "damaged"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(place / "ckpt", folder)
    files = sorted(p.name for p in folder.iterdir())
    name = data.draw(st.sampled_from(files), label="file")
    damage = data.draw(st.sampled_from(["truncate", "bytes", "flip", "delete", "folder"]), label="damage")
    path = folder / name
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:data.draw(st.integers(min_value=0, max_value=max(0, len(raw) - 1)), label="cut")])
    elif damage == "bytes":
        path.write_bytes(data.draw(st.binary(max_size=200), label="bytes"))
    elif damage == "flip":
        at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1), label="at")
        path.write_bytes(raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:])
    elif damage == "delete":
        path.unlink()
    else:
        path.unlink()
        path.mkdir()
    argv = ["merge-weights", folder, "merged_damaged"]
    check(run_accel(argv), argv, f"{damage} {name}")


MANIFEST_PATHS = [("format",), ("version",), ("files",), ("checksums",), ("aliases",), ("layouts",), ("skeleton",),
                  ("skeleton", "models"), ("skeleton", "models", 0), ("skeleton", "models", 0, "0.weight"),
                  ("skeleton", "models", 0, "0.weight", "__tensor__"), ("world_size",), ("step",)]


@fuzz(40)
@given(data=st.data(), signed=st.booleans(), via_state=st.booleans())
def test_a_damaged_accel_checkpoint_is_one_line(place, data, signed, via_state):
    """accel's save_state folder: a manifest value of the wrong shape (signed with its checksum, as a buggy writer
    would, or unsigned, as by hand), or a damaged, missing or replaced file."""
    from accel.checkpoint.layout import MANIFEST, manifest_checksum

    folder = place / "damaged_accel"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(place / "accel_ckpt", folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    what = data.draw(st.sampled_from(["manifest", "file"]), label="what")
    if what == "manifest":
        path = data.draw(st.sampled_from(MANIFEST_PATHS), label="key")
        value = data.draw(wrong_values(), label="value")
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        manifest.pop("checksum")
        try:
            if signed:
                manifest["checksum"] = manifest_checksum(manifest)
        except (RecursionError, ValueError, TypeError):
            pass  # a value its canonical JSON cannot hold: unsigned
        text = dump_text(manifest)
        (folder / MANIFEST).write_text(text)
    else:
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        name = data.draw(st.sampled_from(files), label="file")
        raw = (folder / name).read_bytes()
        text = f"{name}: " + data.draw(st.sampled_from(["truncated", "flipped", "deleted", "bytes"]), label="how")
        if text.endswith("truncated"):
            (folder / name).write_bytes(raw[:len(raw) // 2])
        elif text.endswith("flipped"):
            (folder / name).write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
        elif text.endswith("deleted"):
            (folder / name).unlink()
        else:
            (folder / name).write_bytes(data.draw(st.binary(max_size=100), label="bytes"))
    argv = ["merge-weights", folder / "state" if via_state else folder, "merged_accel"]
    check(run_accel(argv), argv, text[:800])


# ---------------------------------------------------------------------------------------------------------------
# values checked too late before: a tensor-parallel plan's style, torchrun's own arguments
# ---------------------------------------------------------------------------------------------------------------

TP_CONFIG = "num_processes: 2\nuse_cpu: true\nparallelism:\n  tp_size: 2\n  tp_plan:\n    {pattern}: {style}\n"


@pytest.mark.parametrize("style", ["diagonal", "Colwise", "''"])
@pytest.mark.parametrize("command", ["launch", "env"])
def test_a_bad_tp_plan_style_is_refused_before_launch(place, style, command):
    """A bad style fails in every worker once it has the model: `accel launch --dry_run` and `accel env` refuse it
    in one line naming the key, the value and the styles allowed."""
    (place / "train.py").write_text("raise SystemExit('never run')\n")
    (place / "tp.yaml").write_text(TP_CONFIG.format(pattern='"0"', style=style))
    argv = (["launch", "--config_file", "tp.yaml", "--dry_run", "train.py"] if command == "launch"
            else ["env", "--config_file", "tp.yaml"])
    outcome = run_accel(argv)
    check(outcome, argv)
    assert outcome.code == 2, outcome
    line = outcome.stderr.strip()
    assert "key 'parallelism.tp_plan'" in line and "bad style" in line and "'0'" in line, line
    assert "allowed: colwise, rowwise" in line, line


def test_a_tp_plan_naming_nothing_yet_passes_the_launch_check(place):
    """Names need the model (the workers check them); a good style with any name passes the dry run."""
    (place / "train.py").write_text("raise SystemExit('never run')\n")
    (place / "tp.yaml").write_text(TP_CONFIG.format(pattern="no.such.layer", style="colwise"))
    outcome = run_accel(["launch", "--config_file", "tp.yaml", "--dry_run", "train.py"])
    assert outcome.code == 0, outcome


def test_a_bad_tp_plan_style_in_python_is_one_config_error():
    from accel.parallel.tensor_plan import check_plan_styles
    from accel.config import ConfigError

    check_plan_styles({"layers.*.q_proj": "colwise", "no.such": "rowwise"})
    with pytest.raises(ConfigError, match=r"parallelism.tp_plan: 'x': bad style 5; allowed: colwise"):
        check_plan_styles({"x": 5})


@pytest.mark.parametrize("conf", ["join_timeout=abc", "read_timeout=0", "keep_alive_interval=" + "9" * 30,
                                  "store_type=redis", "timeout=1.5"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_rendezvous_option_torchrun_cannot_read_is_one_line(place, conf, dry_run):
    """torchrun reads these only once its agent runs (a launch that began, then exit 1): refused first."""
    (place / "train.py").write_text("raise SystemExit('never run')\n")
    argv = ["launch", "--cpu", "--num_processes", "2", "--rdzv_conf", conf, *(["--dry_run"] if dry_run else []),
            "train.py"]
    outcome = run_accel(argv)
    check(outcome, argv)
    assert outcome.code == 2 and "--rdzv_conf" in outcome.stderr and conf.split("=")[0] in outcome.stderr, outcome


def test_torchrun_refusing_its_arguments_is_exit_2_and_one_line(place, monkeypatch, capsys):
    """Were torchrun to refuse what accel passes it (its parser exits), the launch says so in one line, exit 2."""
    from accel.cli import launch, output
    from accel.config import AccelConfig

    def refuse(argv):
        raise SystemExit(2)

    monkeypatch.setattr(output, "run_agent", refuse)
    before = dict(os.environ)
    try:
        assert launch._run_torchrun(AccelConfig(num_processes=2, use_cpu=True), ["--bogus"], preemptible=False) == 2
    finally:  # _run_torchrun sets the workers' variables (ACCEL_PREEMPTION_DIR, ...): later tests must not inherit them
        os.environ.clear()
        os.environ.update(before)
    err = capsys.readouterr().err
    assert err == "accel launch: error: torchrun refused its arguments (exit code 2)\n", err
