"""Property-based fuzzing of what `accel launch`, `accel env` and `accel config` read: every config key, every flag,
config files, DeepSpeed JSONs, hostfiles and `.accel_env` files. The rule (docs/troubleshooting.md): each input
either works (exit 0) or is refused in ONE line on stderr with exit code 2 and no traceback, before anything starts.

The keys and flags are read from the config dataclasses and `accel`'s parsers, so a new one is fuzzed without a change
here. Examples are derandomized (the same ones on every run) and few enough that the file runs in seconds; a failing
example is printed with what `accel` wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_fuzz import (  # tests/cli_fuzz.py, the shared harness (tests/ is on the path, as for conftest)
    FUZZ,
    SCALE,
    EDGE_TEXTS,
    dump_text,
    flag_values,
    nested_text,
    run_accel,
    wrong_values,
)

from accel.config import AccelConfig, ParallelismConfig

# A longer hunt, by hand: ACCEL_FUZZ_SCALE=10 (cli_fuzz.SCALE), ACCEL_FUZZ_RANDOM=1 new examples on every run
RANDOM = os.environ.get("ACCEL_FUZZ_RANDOM") == "1"


def fuzz(examples: int) -> settings:
    return settings(FUZZ, max_examples=max(1, round(examples * SCALE)), derandomize=not RANDOM)


SCRIPT = "raise SystemExit('the script must never run in a fuzz example')\n"
GOOD_HOSTFILE = "worker-0 slots=2\nworker-1 slots=2\n"
DS_WARNS = '{"zero_optimization": {"stage": 2, "overlap_comm": true}}'  # a warning line, unless a refusal follows


def _schema_keys() -> list[str]:
    """Every config-file key of the schema: AccelConfig's fields, the `parallelism:` ones dotted."""
    keys = []
    for f in dataclasses.fields(AccelConfig):
        if f.name == "parallelism":
            keys += [f"parallelism.{p.name}" for p in dataclasses.fields(ParallelismConfig) if "kind" in p.metadata]
        elif "kind" in f.metadata:
            keys.append(f.name)
    return keys


KEYS = _schema_keys()


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A folder with train.py, HOME pointing inside it and no accel/SLURM variables from the caller; the current
    directory is the folder while the module's tests run."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "train.py").write_text(SCRIPT)
    (root / "home").mkdir()
    (root / "hosts").write_text(GOOD_HOSTFILE)
    (root / "ds_warns.json").write_text(DS_WARNS)
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(("ACCEL_", "SLURM_", "PARALLELISM_CONFIG_")) or name in ("RANK", "WORLD_SIZE",
                                                                                     "LOCAL_RANK", "MASTER_ADDR",
                                                                                     "MASTER_PORT"):
            del os.environ[name]
    os.environ["HOME"] = str(root / "home")
    old_cwd = os.getcwd()
    os.chdir(root)
    try:
        yield root
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(saved)


def check(outcome, argv, inputs: str = "") -> None:
    """The rule, and for a dry run that succeeded: what it would start takes the values (`workers_accept`)."""
    shown = f"accel {' '.join(map(str, argv))[:300]}\n{inputs[:600]}\n{outcome}"
    assert outcome.follows_the_rule(), shown
    if outcome.code == 0 and argv[0] == "launch" and "# the command accel launch runs" in outcome.stdout:
        problem = workers_accept(outcome.stdout)
        assert problem is None, f"{problem}\n{shown}\n{outcome.stdout[-2000:]}"
    elif outcome.code == 0 and argv[0] == "launch" and any(str(a).startswith("--hostfile") for a in argv):
        problem = hosts_accept(outcome.stdout)
        assert problem is None, f"{problem}\n{shown}\n{outcome.stdout[-2000:]}"


def hosts_accept(stdout: str) -> str | None:
    """The ssh commands a --hostfile dry run printed, as exec and ssh take them: no argument over Linux's 128 KiB,
    no NUL byte, and a host that ssh cannot read as an option."""
    import shlex

    for line in stdout.splitlines():
        words = shlex.split(line)
        if any(len(os.fsencode(word)) > 128 * 1024 - 1 or "\x00" in word for word in words):
            return "an argument exec refuses (over 128 KiB, or with a NUL byte)"
        host = words[words.index("BatchMode=yes") + 1] if "BatchMode=yes" in words else None
        if host is not None and host.startswith("-"):
            return f"a host ssh reads as an option: {host[:80]}"
    return None


C_INT_MAX = 2**31 - 1
C_INT_KEYS = ("num_processes", "num_machines", "machine_rank", "gradient_accumulation_steps")  # torch/torchrun ints


def workers_accept(stdout: str) -> str | None:
    """What a dry run printed, checked the way the workers and torchrun would take it, independently of accel's
    checks: the config a worker decodes from ACCEL_LAUNCH_CONFIG (its seconds as a timedelta and as a
    threading.Timer's timeout, its sizes as C ints, the variable within Linux's 128 KiB), and torchrun's arguments
    through torchrun's own parser and config. None when all take it, else what refused it."""
    import datetime
    import logging
    import shlex
    import threading

    from accel.config import config_from_dict

    words = shlex.split(stdout.partition("# the command accel launch runs")[2].split("\n", 1)[1])  # the rest
    variables = {}
    while words and "=" in words[0] and not words[0].startswith("/"):
        name, _, value = words.pop(0).partition("=")
        variables[name] = value
    try:
        if any(len(name) + len(value.encode()) + 1 > 128 * 1024 - 1 for name, value in variables.items()):
            return "an environment variable longer than Linux's 128 KiB limit"
        cfg = config_from_dict(json.loads(variables["ACCEL_LAUNCH_CONFIG"]), "worker")
        datetime.timedelta(seconds=cfg.collective_timeout)
        datetime.timedelta(seconds=cfg.grace_period)
        lock = threading.Lock()
        for seconds in (cfg.collective_timeout, cfg.grace_period):
            lock.acquire(timeout=seconds)  # a free lock: returns at once, after checking the timeout's range
            lock.release()
        sizes = [getattr(cfg, key) for key in C_INT_KEYS] + [
            value for key, value in vars(cfg.parallelism).items() if key.endswith(("_size", "_microbatches"))
            and isinstance(value, int)]
        if any(not -C_INT_MAX - 1 <= size <= C_INT_MAX for size in sizes):
            return f"a size outside a C int: {sizes}"
    except Exception as exc:  # noqa: BLE001 (the oracle's answer)
        return f"a worker refuses the config: {type(exc).__name__}: {exc}"[:500]
    if "torch.distributed.run" in words:
        from torch.distributed import run as torchrun

        argv = words[words.index("torch.distributed.run") + 1:]
        threads = os.environ.get("OMP_NUM_THREADS")
        logging.disable(logging.WARNING)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                torchrun.config_from_args(torchrun.parse_args(argv))
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            return f"torchrun refuses its arguments: {type(exc).__name__}: {exc}"[:500]
        finally:
            logging.disable(logging.NOTSET)
            if threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
    return None


def _document(key: str, value, fmt: str) -> str:
    if "." in key:
        section, sub = key.split(".", 1)
        return dump_text({section: {sub: value}}, fmt)
    return dump_text({key: value}, fmt)


# ---------------------------------------------------------------------------------------------------------------
# (a) every schema key, given a wrong value in a YAML or JSON config file
# ---------------------------------------------------------------------------------------------------------------

@fuzz(4)
@given(data=st.data())
def test_a_wrong_value_of_any_key_is_one_line(place, data):
    """Each example gives every key a wrong value of its own (one key per file), in YAML or JSON, to `accel launch
    --dry_run` or `accel env`."""
    for key in KEYS:
        value = data.draw(wrong_values(), label=key)
        fmt = data.draw(st.sampled_from(["yaml", "json"]), label="format")
        command = data.draw(st.sampled_from(["launch", "env"]), label="command")
        text = _document(key, value, fmt)
        path = place / f"cfg.{fmt}"
        path.write_text(text, encoding="utf-8")
        argv = (["launch", "--dry_run", "--config_file", path, "train.py"] if command == "launch"
                else ["env", "--config_file", path])
        check(run_accel(argv), argv, f"{path.name}: {text}")


def _section_keys() -> list[tuple[str, str]]:
    """(section, key) of Accelerate's config-file sections that accel reads: the keys its launch flags of the same names
    map onto (accel/cli/accelerate_flags.py), the dynamo keys and fp8's backend."""
    from accel.cli.accelerate_flags import ACCEPTED
    from accel.config.accelerate_import import DYNAMO_KEYS

    keys = [(flag.goes_to, name) for name, flag in ACCEPTED.items()
            if flag.goes_to in ("deepspeed_config", "fsdp_config", "parallelism_config")]
    return keys + [("dynamo_config", key) for key in DYNAMO_KEYS] + [("fp8_config", "backend")]


SECTION_KEYS = _section_keys()
SECTION_TYPES = {"deepspeed_config": "DEEPSPEED", "fsdp_config": "FSDP"}  # the distributed_type that reads it


@fuzz(2)
@given(data=st.data())
def test_a_wrong_value_in_an_accelerate_section_is_one_line(place, data):
    """Accelerate's config files: each key of its sections (deepspeed_config:, fsdp_config:, parallelism_config:,
    dynamo_config:, fp8_config:) given a wrong value, the section made the active one."""
    for section, key in SECTION_KEYS:
        value = data.draw(wrong_values(), label=f"{section}.{key}")
        document = {section: {key: value}}
        if section in SECTION_TYPES:
            document["distributed_type"] = SECTION_TYPES[section]
        fmt = data.draw(st.sampled_from(["yaml", "json"]), label="format")
        path = place / f"accelerate.{fmt}"
        text = dump_text(document, fmt)
        path.write_text(text, encoding="utf-8")
        argv = ["launch", "--dry_run", "--cpu", "--config_file", path, "train.py"]
        check(run_accel(argv), argv, f"{path.name}: {text}")


@fuzz(20)
@given(answers=st.lists(flag_values() | st.sampled_from(["", "yes", "no", "2", "1"]), max_size=16))
def test_accel_config_answers_are_one_line(place, answers):
    """`accel config` answered from stdin, one generated answer per line: it saves a config `accel launch` takes, or
    refuses in one line."""
    target = place / "out" / "answers.yaml"
    target.parent.mkdir(exist_ok=True)
    argv = ["config", "--config_file", target]
    text = "\n".join(answer.replace("\n", " ").replace("\r", " ") for answer in answers) + "\n"
    outcome = run_accel(argv, stdin=text)
    check(outcome, argv, text)
    if outcome.code == 0:
        again = ["launch", "--dry_run", "--config_file", target, "train.py"]
        check(run_accel(again), again, target.read_text())
        target.unlink()


# ---------------------------------------------------------------------------------------------------------------
# (b) files: bad encodings, BOMs, NUL bytes, deep nesting, the wrong shape
# ---------------------------------------------------------------------------------------------------------------

GOOD_TEXT = {
    "config": "num_processes: 2\nuse_cpu: true\nparallelism:\n  zero_stage: 2\n",
    "deepspeed": '{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}',
    "hostfile": GOOD_HOSTFILE,
    "accel_env": "NCCL_DEBUG=INFO\nPYTHONFAULTHANDLER=1\n",
}
# inputs a parser chokes on: numbers and dates no Python type holds, aliases, tags, NUL and control characters
NASTY = {
    "config": ["num_processes: " + "9" * 5000 + "\n", "num_processes: 0b" + "1" * 20000 + "\n",
               "grace_period: 2001-13-45\n", "collective_timeout: 1.0e+400\n", "a: &a [*a]\n",
               "x: &x [1, 2]\ny: &y [*x, *x, *x]\nparallelism: [*y, *y, *y]\n", "? [a, b]\n: 1\n",
               "num_processes: !!python/object:os.system 'echo hi'\n", "num_processes: !!binary 'zz'\n",
               'main_process_ip: "a\\0b"\nnum_machines: 2\nnum_processes: 2\n', "1: 2\n",
               "gpu_ids: \"\u00b2,\u0663\"\n", "gpu_ids: 0,0\n", "main_process_ip: -oProxyCommand=x\nnum_machines: 2\n"
               "num_processes: 2\n", "parallelism: {tp_plan: {'*': colwise}}\n", "num_processes: 1_0\n",
               "num_processes: 1:30\n"],
    "deepspeed": ['{"train_batch_size": ' + "9" * 5000 + "}", '{"gradient_clipping": 1e400}',
                  '{"gradient_clipping": NaN}', '{"a": 1, "a": 2}', '{"zero_optimization": {"stage": "auto"}}',
                  '{"zero_optimization": [1]}', '{"fp16": {"enabled": "yes"}}', '{"optimizer": {"params": ' + "x" * 9,
                  '{"scheduler": "' + "x" * 200_000 + '"}'],
    "hostfile": ["w0 slots=" + "9" * 5000 + "\n", "w0 slots=99999999\n", "-oProxyCommand=x slots=1\n",
                 "w\u00e9 slots=1\n", "w0 slots=1\nw0 slots=1\n", "w0\tslots=1\r\nw1 slots=1\r\n", "\u2028 slots=1\n"],
    "accel_env": ["A=1\x00\n", "export A=1\n", "=1\n", "A\n", "A=" + "x" * 200_000 + "\n", "\u00e9=1\n"],
}
NESTED_UNDER = {"config": ("num_processes", "parallelism", "tp_plan"), "deepspeed": ("zero_optimization", "fp16")}


@st.composite
def damaged_bytes(draw, kind: str) -> bytes:
    """A file of `kind` as it may arrive: in another encoding, with a BOM, NUL or stray bytes, nested deeply, of the
    wrong shape, or random bytes."""
    good = GOOD_TEXT[kind]
    how = draw(st.sampled_from(["bom", "utf16", "latin1", "nul", "stray", "deep", "shape", "random", "edge",
                                "nasty", "nasty"]))
    if how == "bom":
        return draw(st.sampled_from([b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff"])) + good.encode()
    if how == "utf16":
        return good.encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))
    if how == "latin1":
        return (good + "# caf\u00e9 \u00e0 d\u00e9faut\n").encode("latin-1")
    if how in ("nul", "stray"):
        data = good.encode()
        at = draw(st.integers(0, len(data)))
        extra = b"\x00" if how == "nul" else draw(st.sampled_from([b"\xff", b"\xc3", b"\x80\x80", b"\xed\xa0\x80"]))
        return data[:at] + extra + data[at:]
    if how == "deep":
        depth = draw(st.integers(50, 20000))
        key = draw(st.sampled_from([None, *NESTED_UNDER.get(kind, ())]))
        return nested_text(depth, draw(st.sampled_from(["[", "{"])), key).encode()
    if how == "shape":
        shape = draw(st.sampled_from(["[1, 2]", "42", '"text"', "null", "[]", "{}", "true", "- a\n- b\n", "1.5"]))
        return shape.encode()
    if how == "edge":
        return draw(st.sampled_from(EDGE_TEXTS)).encode("utf-8", "surrogatepass")
    if how == "nasty":
        return draw(st.sampled_from(NASTY[kind])).encode("utf-8", "surrogatepass")
    return draw(st.binary(max_size=200))


def _file_argv(kind: str, path: Path) -> list:
    if kind == "config":
        return ["launch", "--dry_run", "--config_file", path, "train.py"]
    if kind == "deepspeed":
        return ["launch", "--dry_run", "--cpu", "--deepspeed_config_file", path, "train.py"]
    if kind == "hostfile":
        return ["launch", "--dry_run", "--cpu", "--hostfile", path, "train.py"]
    return ["launch", "--dry_run", "--cpu", "--hostfile", "hosts", "train.py"]  # ./.accel_env is read


@pytest.mark.parametrize("kind,name", [("config", "cfg.yaml"), ("config", "cfg.json"), ("deepspeed", "ds.json"),
                                       ("hostfile", "hostfile"), ("accel_env", ".accel_env")])
@fuzz(20)
@given(data=st.data())
def test_a_damaged_file_is_one_line(place, kind, name, data):
    content = data.draw(damaged_bytes(kind))
    path = place / name
    path.write_bytes(content)
    try:
        for argv in (_file_argv(kind, path), ["env", "--config_file", path] if kind == "config" else None):
            if argv is not None:
                check(run_accel(argv), argv, f"{name}: {content[:600]!r}")
    finally:
        path.unlink()


@fuzz(20)
@given(value=wrong_values(), fmt=st.sampled_from(["yaml", "json"]))
def test_a_deepspeed_json_named_by_a_config_file_is_checked_alike(place, value, fmt):
    """A DeepSpeed JSON of the wrong shape, named by a config file's `deepspeed_config_file` key."""
    (place / "named_ds.json").write_text(dump_text(value, "json"))
    cfg = place / f"named.{fmt}"
    cfg.write_text(dump_text({"use_cpu": True, "deepspeed_config_file": "named_ds.json"}, fmt))
    argv = ["launch", "--dry_run", "--config_file", cfg, "train.py"]
    check(run_accel(argv), argv, dump_text(value, "json")[:600])


# ---------------------------------------------------------------------------------------------------------------
# (c) every flag of accel launch, accel env and accel config, given generated values
# ---------------------------------------------------------------------------------------------------------------

def _subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """`accel`'s parsers of launch, env and config (and config's subcommands), by command line prefix."""
    from accel.cli.main import build_parser

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
        if path:
            found[" ".join(path)] = parser

    walk(build_parser(), ())
    return {name: parser for name, parser in found.items() if name.split()[0] in ("launch", "env", "config")}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions
            if action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            and action.dest != "dry_run"]


PARSERS = _subcommand_parsers()
OPTIONS = {command: _options(parser) for command, parser in PARSERS.items()}
# launch is the command with the most flags (and the only one that starts processes): it gets most examples
COMMANDS = [name for name in sorted(PARSERS) for _ in range(4 if name == "launch" else 2 if name == "env" else 1)]


def plausible_values(action: argparse.Action) -> st.SearchStrategy:
    """Values a flag is meant to take (its choices, the names in its metavar, small numbers), so that examples also
    get past the first check and reach the config, torchrun's arguments and the hostfile."""
    metavar = str(action.metavar or "")
    named = metavar.strip("{}").split(",") if metavar.startswith("{") else []
    picks = [*map(str, action.choices or ()), *named, "1", "2", "4", "0", "true", "false", "0,1", "localhost",
             "hosts", "train.py", "ds_warns.json", "join_timeout=60", "3600", "0.5"]
    return st.sampled_from(picks)


def _safe_path(place: Path, text: str) -> str:
    """A generated path confined to the fuzz folder (accel config writes there)."""
    return str(place / "out" / text.replace("/", "_").replace("\x00", "_")) if text else text


@fuzz(160)
@given(data=st.data())
def test_flags_with_generated_values_are_one_line(place, data):
    """1 to 3 flags of a command with generated values (`--flag=value`, so a value may start with "-"); half of the
    launches also run 2 processes on the CPU, so the values reach torchrun's arguments."""
    (place / "out").mkdir(exist_ok=True)
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    chosen = data.draw(st.lists(st.sampled_from(OPTIONS[command]), min_size=1, max_size=3,
                                unique_by=lambda action: action.dest), label="flags")
    flags: list[str] = []
    for action in chosen:
        flag = action.option_strings[0]
        if action.nargs == 0:
            flags.append(flag)
            continue
        value = data.draw(flag_values() | plausible_values(action), label=flag)
        if command.startswith("config") and "config_file" in action.dest:
            value = _safe_path(place, value)
        flags.append(f"{flag}={value}")
    if command == "launch":
        base = data.draw(st.sampled_from([[], ["--cpu", "--num_processes=2"]]), label="base")
        argv = ["launch", "--dry_run", *base, *flags, "train.py"]
    else:
        argv = [*command.split(), *flags]
    check(run_accel(argv, stdin=""), argv)


def test_every_key_and_command_is_fuzzed():
    """The enumeration finds the schema's keys and the commands' flags (so nothing is fuzzed vacuously)."""
    assert {"num_processes", "collective_timeout", "parallelism.tp_size", "parallelism.zero_stage"} <= set(KEYS)
    assert {"launch", "env", "config", "config default"} <= set(PARSERS)
    launch_flags = {flag for action in OPTIONS["launch"] for flag in action.option_strings}
    assert {"--num_processes", "--collective_timeout", "--hostfile", "--monitor_interval"} <= launch_flags


# ---------------------------------------------------------------------------------------------------------------
# the issue's examples, with the lines they get
# ---------------------------------------------------------------------------------------------------------------

SECONDS_ALLOWED = "allowed: a finite number of seconds from 1 to 31536000"
EXAMPLES = [
    ("seconds-overflow", {"c.yaml": "collective_timeout: 1.0e+308\n"}, ["env", "--config_file", "c.yaml"],
     ["c.yaml: key 'collective_timeout': bad value 1e+308;", SECONDS_ALLOWED]),
    ("seconds-flag-inf", {}, ["launch", "--dry_run", "--grace_period", "inf", "train.py"],
     ["key 'grace_period': bad value inf;", SECONDS_ALLOWED]),
    ("int-overflow", {"c.json": '{"gradient_accumulation_steps": 2147483648}'},
     ["launch", "--dry_run", "--config_file", "c.json", "train.py"],
     ["key 'gradient_accumulation_steps': bad value 2147483648; allowed: an integer from 1 to 2147483647"]),
    ("processes-on-one-machine", {}, ["launch", "--dry_run", "--cpu", "--num_processes", "100000", "train.py"],
     ["key 'num_processes': bad value 100000; allowed: at most 4096 processes on one machine"]),
    ("deep-yaml", {"c.yaml": "parallelism: " + "[" * 3000 + "]" * 3000 + "\n"},
     ["launch", "--dry_run", "--config_file", "c.yaml", "train.py"], ["c.yaml: nested more than 64 levels deep"]),
    ("deep-json", {"ds.json": '{"a": ' * 5000 + "1" + "}" * 5000},
     ["launch", "--dry_run", "--deepspeed_config_file", "ds.json", "train.py"], ["ds.json: nested more than 64"]),
    ("yaml-list", {"c.yaml": "- num_processes: 2\n"}, ["env", "--config_file", "c.yaml"],
     ["expected a mapping of keys to values at the top level, got list"]),
    ("deepspeed-list", {"ds.json": "[1, 2]", "c.yaml": "deepspeed_config_file: ds.json\n"},
     ["launch", "--dry_run", "--config_file", "c.yaml", "train.py"],
     ["ds.json: expected a JSON object of DeepSpeed keys at the top level, got list"]),
    ("yaml-date", {"c.yaml": "grace_period: 2001-13-45\n"}, ["env", "--config_file", "c.yaml"],
     ["c.yaml: not valid YAML at line 1: '2001-13-45' is no number or date Python can hold"]),
    ("hostfile-latin1", {"hosts": "w\u00f6rker slots=1\n"}, ["launch", "--dry_run", "--hostfile", "hosts", "train.py"],
     ["--hostfile hosts: not UTF-8 text (byte 0xf6 at offset 1)"]),
    ("hostfile-option-host", {"hosts": "-oProxyCommand=x slots=1\n"},
     ["launch", "--dry_run", "--hostfile", "hosts", "train.py"], ["is not a host name or address"]),
    ("env-file-nul", {"hosts": "w0 slots=1\n", ".accel_env": "A=1\x00\n"},
     ["launch", "--dry_run", "--hostfile", "hosts", "train.py"], [".accel_env:1: the value of A holds a NUL byte"]),
    ("host-ip-option", {}, ["launch", "--dry_run", "--cpu", "--num_machines", "2", "--num_processes", "2",
                            "--main_process_ip=-oops", "train.py"],
     ["key 'main_process_ip': bad value '-oops'; allowed: a host name or IP address"]),
    ("torchrun-refuses", {}, ["launch", "--dry_run", "--cpu", "--num_processes", "2", "--role=-x", "train.py"],
     ["torchrun refused its arguments: argument --role: expected one argument"]),
    ("warning-then-refusal", {}, ["launch", "--dry_run", "--cpu", "--num_processes", "2", "--deepspeed_config_file",
                                  "ds_warns.json", "--role=-x", "train.py"], ["torchrun refused its arguments"]),
    ("monitor-interval-inf", {}, ["launch", "--dry_run", "--cpu", "--num_processes", "2", "--monitor_interval", "inf",
                                  "train.py"], ["--monitor_interval: bad value 'inf'"]),
]


@pytest.mark.parametrize("files,argv,needles", [e[1:] for e in EXAMPLES], ids=[e[0] for e in EXAMPLES])
def test_the_issue_examples_are_one_line(place, files, argv, needles):
    latin1 = {"hosts"} if "\u00f6" in files.get("hosts", "") else set()
    for name, text in files.items():
        (place / name).write_bytes(text.encode("latin-1" if name in latin1 else "utf-8"))
    try:
        outcome = run_accel(argv)
    finally:
        for name in files:
            (place / name).unlink()
    check(outcome, argv)
    assert outcome.code == 2 and all(needle in outcome.stderr for needle in needles), (needles, outcome.stderr)


def test_accel_config_refuses_a_huge_num_processes_and_saves_nothing(place):
    target = place / "out" / "huge.yaml"
    target.parent.mkdir(exist_ok=True)
    outcome = run_accel(["config", "--config_file", target], stdin="1\nyes\n99999999999999999999\n")
    check(outcome, ["config"])
    assert outcome.code == 2 and "allowed: an integer from 1 to 2147483647" in outcome.stderr, outcome.stderr
    assert not target.exists()
    outcome = run_accel(["config", "--config_file", target], stdin="1\nyes\n100000\n")
    assert outcome.code == 2 and "at most 4096 processes on one machine" in outcome.stderr, outcome.stderr
    assert not target.exists()
