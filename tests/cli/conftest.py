"""Helpers for command-line tests: run ``python -m leanml ...`` in a subprocess and check how it fails.

Every bad-input test should assert, through :func:`assert_user_error`, that the command exits with
code 2, prints exactly one ``leanml: error: ...`` line (plus at most one hint line), never a
traceback, and, through :func:`snapshot` / :func:`assert_unchanged`, that it left the output tree as
it was. The fixtures build tiny random models and text files in temporary folders so each case runs
in a few seconds and most fail in validation before anything heavy is loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CliResult:
    """Exit code and captured output of one ``leanml`` run."""

    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("leanml: error:")]

    def __str__(self) -> str:  # shown by pytest when an assertion fails
        return f"exit {self.code}\n--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}"


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a CLI subprocess: offline, one thread, ``src`` importable; ``env`` wins."""
    base = dict(os.environ)
    base.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    base.pop("LEANML_DEBUG", None)
    src = str(ROOT / "src")
    base["PYTHONPATH"] = src + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    base.update(env or {})
    return base


def run_cli(args: list[str], cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> CliResult:
    """Run ``python -m leanml *args`` and return its exit code, stdout and stderr."""
    proc = subprocess.run([sys.executable, "-m", "leanml", *map(str, args)], cwd=cwd, env=cli_env(env),
                          capture_output=True, text=True, timeout=timeout)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def start_cli(args: list[str], cwd: str | os.PathLike | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m leanml *args`` without waiting (for signal tests); stdout/stderr are pipes."""
    return subprocess.Popen([sys.executable, "-m", "leanml", *map(str, args)], cwd=cwd, env=cli_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_no_traceback(result: CliResult) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, str(result)


def assert_user_error(result: CliResult, *needles: str, code: int = 2) -> str:
    """A clean user error: exit ``code``, one ``leanml: error:`` line, at most one more stderr line (a hint),
    no traceback; each of ``needles`` appears in the error line. Returns the error line."""
    assert result.code == code, str(result)
    assert_no_traceback(result)
    assert len(result.error_lines) == 1, str(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= 2, str(result)
    if len(lines) == 2:
        hint = lines[1] if lines[0].startswith("leanml: error:") else lines[0]
        assert "--help" in hint, str(result)
    line = result.error_lines[0]
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}\n{result}"
    return line


def snapshot(*roots: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``roots`` (hidden ones included) with its size and mtime."""
    state: dict[str, tuple[int, int]] = {}
    for root in map(Path, roots):
        if not root.exists():
            continue
        for path in [root, *sorted(root.rglob("*"))]:
            st = path.lstat()
            state[str(path)] = (st.st_size if path.is_file() else -1, st.st_mtime_ns)
    return state


def assert_unchanged(before: dict[str, tuple[int, int]], *roots: str | os.PathLike) -> None:
    """Nothing under ``roots`` was added, removed or rewritten since ``before = snapshot(*roots)``."""
    after = snapshot(*roots)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(after) & set(before) if after[k] != before[k] and not Path(k).is_dir())
    assert not (added or removed or changed), f"added {added}, removed {removed}, changed {changed}"


def save_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 256):
    """A word-level tokenizer over a fixed vocabulary (letters, digits, common words), saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    words = [chr(c) for c in range(33, 127)]
    common = ("the and to of a i you my in that is not it with me be your his this but he for have as thou so "
              "will what him thy all her do no by shall if are we our on thee lord good now come from o").split()
    vocab = list(dict.fromkeys(specials + common + words))[:vocab_size]
    vocab += [f"<extra{i}>" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def save_tiny_llama(path: str | os.PathLike, layers: int = 2) -> Path:
    """A tiny random LLaMA with :func:`save_tiny_tokenizer`'s tokenizer, saved as a model directory."""
    from builders import tiny_llama

    path = Path(path)
    tiny_llama(vocab=256, layers=layers).save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


SAMPLE_TEXT = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
               "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles "
               "And by opposing end them. ") * 40


@pytest.fixture(scope="session")
def cli_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random LLaMA (vocab 256, 128 positions) with a word-level tokenizer; do not modify it."""
    return save_tiny_llama(tmp_path_factory.mktemp("cli-model") / "tiny")


@pytest.fixture(scope="session")
def cli_text(tmp_path_factory) -> Path:
    """A UTF-8 text file long enough for a few calibration and test windows of the tiny model."""
    path = tmp_path_factory.mktemp("cli-text") / "text.txt"
    path.write_text(SAMPLE_TEXT, encoding="utf-8")
    return path


@pytest.fixture
def model_copy(cli_model_dir, tmp_path) -> Path:
    """A private copy of the tiny model directory, for tests that damage it."""
    import shutil

    return Path(shutil.copytree(cli_model_dir, tmp_path / "model"))
