"""`accel config`: write the user's config file by answering a few questions (or `accel config default`).

The questionnaire reads one answer per line from stdin, so it can be scripted:

    printf '1\\nyes\\n4\\n' | accel config --config_file my.yaml

An empty answer takes the default shown in [brackets]; when stdin ends, every remaining question takes its
default. An invalid answer prints why and the same question is asked again. The answers are validated with
the same code as config files (`accel.config.parse_layer` / `build_config`), including the rules that
involve several keys, and with the checks `accel launch` and `accel env` run (`accel.backends.launchable.
check_launchable`: the layout on num_processes, the combinations accel has, fp8's torchao), so a saved config
is one `accel launch` accepts. A refused combination prints the one-line error and asks the offending question
again. When stdin ends right after an invalid or refused answer, nothing is saved and `accel config` exits 2
with that error. A choice question offers the values the config schema declares for its key (`accel.config.schema`),
the same ones the error for another answer lists; fp8 without torchao installed is refused in one line naming the
package, and asked again. The file is saved to `--config_file`, else `$ACCEL_CONFIG_FILE`, else
`~/.cache/accel/default_config.yaml`. When that file exists, the first question is whether to overwrite it (Enter, "no"
or the end of stdin leave it unchanged and exit 0, as `accel config default` does without --force); `--force`
overwrites without asking.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.cli import config_flags
from accel.cli.config_flags import field_spec
from accel.cli._common import DEFAULT_MULTI_MACHINE_PORT, UsageError, add_flag

from accel.config import (
    PACKAGED_DEFAULT,
    USER_CONFIG_ENV,
    AccelConfig,
    ConfigError,
    build_config,
    config_save_path,
    default_user_config_path,
    parse_layer,
    read_config_file,
)
from accel.backends.launchable import check_launchable
from accel.config.errors import shown

ANSWERS_SOURCE = "accel config answers"
REQUIRED = object()  # a question without a default


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "config",
        help="write a config file by answering questions",
        description="Answer a few questions (one per line on stdin; Enter takes the [default]) and save the "
        "config file that `accel launch` and `Accelerator` read. An existing file is overwritten only after you "
        "answer yes to the first question, or with --force.",
        allow_abbrev=False,
    )
    add_flag(parser, "config_file", metavar="PATH", default=None,
             help=f"where to save (default: ${USER_CONFIG_ENV}, else {_home_path(default_user_config_path())})")
    add_flag(parser, "force", dest="force_overwrite", action="store_true",
             help="overwrite an existing file without asking")
    parser.set_defaults(func=run_questionnaire)
    sub = parser.add_subparsers(dest="config_command", metavar="{default}")
    default = sub.add_parser(
        "default",
        help="write the default config without questions",
        description="Write the packaged default config (optionally with a mixed precision) without questions. "
        "An existing file is left alone unless --force is given.",
        allow_abbrev=False,
    )
    add_flag(default, "config_file", dest="default_config_file", metavar="PATH", default=None,
             help="where to save (same default as `accel config`)")
    config_flags.add(default, "mixed_precision")
    add_flag(default, "force", action="store_true", help="overwrite an existing file")
    default.set_defaults(func=run_default)
    return parser


def _home_path(path: Path) -> str:
    home = str(Path(os.path.expanduser("~")))
    text = str(path)
    return "~" + text[len(home):] if text.startswith(home + os.sep) else text


def target_path(config_file: str | None) -> Path:
    """Where `accel config` saves: `--config_file`, else `$ACCEL_CONFIG_FILE`, else the default user path."""
    return config_save_path(config_file)


def packaged_defaults() -> AccelConfig:
    return build_config([read_config_file(PACKAGED_DEFAULT)], str(PACKAGED_DEFAULT))


# -------------------------------------------------------------------------------------------------------
# the questions
# -------------------------------------------------------------------------------------------------------

@dataclass
class Question:
    key: str                                   # dotted config key, e.g. "parallelism.zero_stage"
    prompt: str
    kind: str                                  # "int", "bool", "choice" or "str"
    default: Callable[[dict, AccelConfig], Any]  # (answers so far, packaged defaults) -> default (or REQUIRED)
    applies: Callable[[dict], bool] = lambda answers: True
    choices: tuple = ()
    default_label: str | None = None           # shown instead of the default value (e.g. for None)
    saved: bool = True                         # False: an answer that only decides later questions (no config key)
    lo: float | None = None                    # the key's bounds (its spec's), checked with the config's rules
    hi: float | None = None


def _get(cfg: AccelConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _from_defaults(key: str) -> Callable[[dict, AccelConfig], Any]:
    return lambda answers, defaults: _get(defaults, key)


def _multi_machine(answers: dict) -> bool:
    return answers.get("num_machines", 1) > 1


def schema_choices(key: str) -> tuple[str, ...]:
    """The values the config schema declares for `key` (dotted for a section's field): what a choice question offers,
    and what the error for any other answer lists (accel.config.schema's `allowed_values`), so the two agree."""
    return tuple(field_spec(key)["choices"])


# "Sequence length parallelism" answers: which degree question follows (sp_size, cp_size; none: neither). The
# answer itself is no config key (Question.saved False).
SEQUENCE_CHOICES = ("none", "sp", "cp")


def _sequence_default(answers: dict, defaults: AccelConfig) -> str:
    par = defaults.parallelism
    return "sp" if par.sp_size > 1 else "cp" if par.cp_size > 1 else "none"


def _sequence_is(kind: str) -> Callable[[dict], bool]:
    return lambda answers: answers.get("sequence_parallelism", "none") == kind


def _fault_tolerant(answers: dict) -> bool:
    return bool(answers.get("fault_tolerance.enabled", False))


def _degree_default(key: str) -> Callable[[dict, AccelConfig], Any]:
    """The packaged degree when above 1, else 2 (the question is asked only once sp or cp was chosen)."""
    return lambda answers, defaults: max(_get(defaults, key), 2)


def asked(key: str, default: Callable[[dict, AccelConfig], Any] | None = None,
          applies: Callable[[dict], bool] = lambda answers: True, default_label: str | None = None) -> Question:
    """The question of config key `key`: its prompt (the spec's `ask`), kind, choices and bounds come from the key's
    spec (the flag and the reference row come from the same one); `default` is the packaged default's value unless
    given."""
    meta = field_spec(key)
    if not meta["ask"]:
        raise ValueError(f"config key {key!r} has no question (its spec has no `ask`)")
    kind = ("bool" if meta["kind"] is bool else "choice" if meta["choices"] else "int" if meta["kind"] is int
            else "str")
    return Question(key, meta["ask"], kind, default or _from_defaults(key), applies, choices=tuple(meta["choices"]),
                    default_label=default_label, lo=meta["lo"], hi=meta["hi"])


QUESTIONS: list[Question] = [
    asked("num_machines"),
    asked("machine_rank", applies=_multi_machine),
    asked("main_process_ip", lambda answers, defaults: defaults.main_process_ip or REQUIRED, _multi_machine),
    asked("main_process_port", lambda answers, defaults: defaults.main_process_port or DEFAULT_MULTI_MACHINE_PORT,
          _multi_machine),
    asked("rdzv_backend", applies=_multi_machine),
    asked("use_cpu"),
    asked("num_processes", lambda answers, defaults: max(defaults.num_processes, answers.get("num_machines", 1))),
    asked("gpu_ids", applies=lambda answers: not answers.get("use_cpu", False)),
    asked("mixed_precision"),
    asked("gradient_accumulation_steps"),
    asked("parallelism.zero_stage"),
    asked("parallelism.offload_optimizer",  # CPU offload needs ZeRO 2 or 3
          applies=lambda answers: answers.get("parallelism.zero_stage", 0) >= 2),
    asked("parallelism.tp_size"),
    asked("parallelism.pp_size"),
    asked("parallelism.pp_schedule", applies=lambda answers: answers.get("parallelism.pp_size", 1) > 1),
    asked("parallelism.pp_microbatches", applies=lambda answers: answers.get("parallelism.pp_size", 1) > 1,
          default_label="pp_size"),
    Question("sequence_parallelism", "Sequence length parallelism for long sequences (sp: Ulysses, all-to-all over "
             "the heads; cp: context parallel, K/V all-gathered)?", "choice", _sequence_default,
             choices=SEQUENCE_CHOICES, saved=False),
    asked("parallelism.sp_size", _degree_default("parallelism.sp_size"), _sequence_is("sp")),
    asked("parallelism.cp_size", _degree_default("parallelism.cp_size"), _sequence_is("cp")),
    asked("parallelism.ep_size"),
    asked("fault_tolerance.enabled"),
    asked("fault_tolerance.group_size", applies=_fault_tolerant),
    asked("fault_tolerance.min_replicas", applies=_fault_tolerant),
    asked("fault_tolerance.lighthouse", applies=_fault_tolerant),
]
QUESTION_BY_KEY = {q.key: q for q in QUESTIONS}
UNSAVED = frozenset(q.key for q in QUESTIONS if not q.saved)


def nest(answers: dict) -> dict:
    """{"a": 1, "parallelism.b": 2} -> {"a": 1, "parallelism": {"b": 2}}."""
    raw: dict = {}
    for key, value in answers.items():
        if "." in key:
            section, sub = key.split(".", 1)
            raw.setdefault(section, {})[sub] = value
        else:
            raw[key] = value
    return raw


def build_from_answers(answers: dict, source: str = ANSWERS_SOURCE) -> AccelConfig:
    """Validate the answers as one config layer over the packaged default, cross-field rules included (the
    answers that only decide later questions are not config keys: left out)."""
    saved = {key: value for key, value in answers.items() if key not in UNSAVED}
    layers = [read_config_file(PACKAGED_DEFAULT), parse_layer(nest(saved), source)]
    return build_config(layers, source)


def check_answers(answers: dict, source: str = ANSWERS_SOURCE) -> AccelConfig:
    """`build_from_answers` plus the checks `accel launch` runs before starting any process."""
    return check_launchable(build_from_answers(answers, source), source)


def _refused(answers: dict) -> bool:
    try:
        check_answers(answers)
    except ConfigError:
        return True
    return False


def offending_key(answers: dict, defaults: AccelConfig) -> str | None:
    """For a refusal that names no key (the combination check's): the latest answered question whose own
    default would make the combination acceptable, i.e. the answer that completed the refused combination."""
    for question in reversed(QUESTIONS):
        if question.key not in answers:
            continue
        default = question.default(answers, defaults)
        if default is REQUIRED or default == answers[question.key]:
            continue
        if not _refused(_applicable({**answers, question.key: default})):
            return question.key
    return None


def _applicable(answers: dict) -> dict:
    """The answers to the questions that still apply (a changed answer can make later ones moot)."""
    kept: dict = {}
    for question in QUESTIONS:
        if question.key in answers and question.applies(kept):
            kept[question.key] = answers[question.key]
    return kept


def error_key(exc: ConfigError) -> str | None:
    """The config key a ConfigError names (`... key 'num_processes': ...`)."""
    match = re.search(r"key '([\w.]+)'", str(exc))
    return match.group(1) if match else None


# -------------------------------------------------------------------------------------------------------
# asking
# -------------------------------------------------------------------------------------------------------

class StdinEnded(Exception):
    pass


class Asker:
    """Reads one answer per line (input()-style, so piped answers work); remembers when stdin ended."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.eof = False
        self.echo = not sys.stdin.isatty()  # piped: show each answer so the transcript reads as a dialogue

    def read(self, prompt: str) -> str | None:
        if self.eof:
            self.out.write(prompt + "\n")
            return None
        try:
            text = input(prompt)
        except EOFError:
            self.eof = True
            self.out.write("\n")
            return None
        if self.echo:
            self.out.write(text + "\n")
        return text

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _convert(question: Question, text: str) -> Any:
    text = text.strip()
    if question.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number") from None
    if question.kind == "bool":
        lowered = text.lower()
        if lowered in ("y", "yes", "true", "1"):
            return True
        if lowered in ("n", "no", "false", "0"):
            return False
        raise ValueError(f"{text!r}: please answer yes or no")
    if not question.saved and question.choices:  # no config key to check it: checked here
        for choice in question.choices:
            if text.lower() == choice.lower():
                return choice
        raise ValueError(f"{text!r}: please answer one of {', '.join(question.choices)}")
    return text  # choices are checked (case-insensitively) by parse_layer


def _tentative(answers: dict, defaults: AccelConfig, upto: Question) -> dict:
    """The answers so far plus the defaults of the questions still to come (for early cross-field checks)."""
    full = dict(answers)
    after = False
    for q in QUESTIONS:
        if q is upto:
            after = True
            continue
        if after and q.key not in full and q.applies(full):
            value = q.default(full, defaults)
            if value is not REQUIRED:
                full[q.key] = value
    return full


def ask(question: Question, answers: dict, defaults: AccelConfig, asker: Asker) -> Any:
    """Ask until the answer is valid on its own and does not break a rule involving this key."""
    default = question.default(answers, defaults)
    if question.kind == "choice":
        hint = " (" + "/".join(question.choices) + ")"
    elif question.kind == "bool":
        hint = " (yes/no)"
    else:
        hint = ""
    if default is REQUIRED:
        shown = ""
    elif question.default_label is not None and default is None:
        shown = f" [{question.default_label}]"
    else:
        shown = f" [{_show(default)}]"
    prompt = f"{question.prompt}{hint}{shown}: "
    refusal: Exception | None = None  # the last refused answer: at end of input it is the error (nothing is saved)
    while True:
        text = asker.read(prompt)
        if text is None and refusal is not None:
            raise refusal
        if text is None or not text.strip():
            if default is REQUIRED:
                if text is None:
                    raise UsageError(f"stdin ended before '{question.key}' was answered, and it has no default")
                asker.say("  an answer is required")
                continue
            value = default
        else:
            try:
                value = _convert(question, text)
            except ValueError as exc:
                asker.say(f"  {exc}")
                refusal = UsageError(f"your answer to '{question.key}': {exc}")
                continue
        trial = dict(answers)
        trial[question.key] = value
        try:
            parse_layer(nest({question.key: value} if question.saved else {}), "your answer")
            tentative = _tentative(trial, defaults, question)
            cfg = build_from_answers(tentative, "your answer")
        except ConfigError as exc:
            # a rule about another key may fail only because a later question is not answered yet
            if error_key(exc) == question.key:
                if text is None:
                    raise
                asker.say(f"  {exc}")
                refusal = exc
                continue
            return value
        try:
            check_launchable(cfg, "your answer")
        except ConfigError as exc:
            # refused because of this answer (its default would pass): ask it again
            if offending_key(tentative, defaults) == question.key:
                if text is None:
                    raise
                asker.say(f"  {exc}")
                refusal = exc
                continue
        return value


def _ask_remaining(answers: dict, defaults: AccelConfig, asker: Asker) -> dict:
    """Ask every question that applies and is not answered yet; drop answers that no longer apply."""
    answers = _applicable(answers)
    for question in QUESTIONS:
        if question.key not in answers and question.applies(answers):
            answers[question.key] = ask(question, answers, defaults, asker)
    return _applicable(answers)


def questionnaire(asker: Asker) -> AccelConfig:
    """Ask, then re-ask what the cross-field rules or the combination check refuse, until both accept."""
    defaults = packaged_defaults()
    answers = _ask_remaining({}, defaults, asker)
    for _ in range(len(QUESTIONS) * 3):
        try:
            return check_answers(answers)
        except ConfigError as exc:
            key = error_key(exc)
            if key is None or key not in QUESTION_BY_KEY:
                key = offending_key(answers, defaults)
            if key is None or key not in answers or asker.eof:
                raise
            asker.say(f"  {exc}")
            answers[key] = ask(QUESTION_BY_KEY[key], answers, defaults, asker)
            answers = _ask_remaining(answers, defaults, asker)
    return check_answers(answers)


# -------------------------------------------------------------------------------------------------------
# commands
# -------------------------------------------------------------------------------------------------------

def run_questionnaire(args: argparse.Namespace) -> int:
    path = target_path(args.config_file)
    check_save_target(path)
    asker = Asker()
    asker.say(f"accel config: answer each question; press Enter for the default in [brackets]. "
              f"Saving to {path}")
    if path.exists() and not getattr(args, "force_overwrite", False) and not confirm_overwrite(path, asker):
        sys.stdout.flush()
        sys.stderr.write(f"accel config: {path} already exists; it was not changed (answer yes to overwrite it, "
                         "pass --force, or choose another --config_file)\n")
        return 0
    cfg = questionnaire(asker)
    saved = save(cfg, path)
    asker.say(f"Configuration saved to {saved.resolve()}")
    return 0


OVERWRITE = Question("overwrite", "", "bool", lambda answers, defaults: False, saved=False)  # yes/no, no config key


def confirm_overwrite(path: Path, asker: Asker) -> bool:
    """Ask whether to overwrite the existing `path`: yes overwrites; no, Enter or the end of stdin leave it."""
    prompt = f"{path} already exists. Overwrite it? (yes/no) [no]: "
    while True:
        text = asker.read(prompt)
        if text is None or not text.strip():
            return False
        try:
            return bool(_convert(OVERWRITE, text))
        except ValueError as exc:
            asker.say(f"  {exc}")


def run_default(args: argparse.Namespace) -> int:
    path = target_path(args.default_config_file or args.config_file)
    check_save_target(path)
    if path.exists() and not (args.force or getattr(args, "force_overwrite", False)):
        sys.stderr.write(f"accel config default: {path} already exists; it was not changed "
                         "(run `accel config`, pass --force, or choose another --config_file)\n")
        return 0
    raw = {} if args.mixed_precision is None else {"mixed_precision": args.mixed_precision}
    layers = [read_config_file(PACKAGED_DEFAULT), parse_layer(raw, "accel config default flags")]
    cfg = check_launchable(build_config(layers, "accel config default flags"), "accel config default flags")
    saved = save(cfg, path)
    print(f"Configuration saved to {saved.resolve()}")
    return 0


def check_save_target(path: Path) -> None:
    """Refuse, before any question, a target that cannot be a file (a folder, a path the OS refuses)."""
    if "\x00" in str(path):
        raise UsageError(f"config file {shown(str(path))}: a path cannot hold a NUL byte; allowed: the path of a YAML "
                         "file to write (--config_file)")
    try:
        os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno in (errno.ENAMETOOLONG, errno.ELOOP, errno.EACCES):
            raise UsageError(f"config file {path}: {exc.strerror}; allowed: the path of a YAML file to write "
                             "(--config_file)") from None
        return  # e.g. a parent that is a file: saving says so
    if path.is_dir():
        raise UsageError(f"config file {path} is a directory; allowed: the path of a YAML file to write "
                         "(--config_file)")


def save(cfg: AccelConfig, path: Path) -> Path:
    """`cfg.save`, with a file system refusal (permissions, a file where a folder should be) as one line."""
    try:
        return cfg.save(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot write the config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
