"""Helpers for command-line tests: run ``python -m leanml ...`` in a subprocess and check how it fails.

Every bad-input test should assert, through :func:`assert_user_error`, that the command exits with
code 2, prints exactly one line, ``leanml: error: ...``, never a
traceback, and, through :func:`snapshot` / :func:`assert_unchanged`, that it left the output tree as
it was. The fixtures build tiny random models and text files in temporary folders so each case runs
in a few seconds and most fail in validation before anything heavy is loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import time
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


#: environment variables that leanml reads when a command runs (not at import), so a forked child may set them
RUNTIME_ENV = {"LEANML_DEBUG", "LEANML_CACHE"}
_idle: queue.SimpleQueue = queue.SimpleQueue()
_all_servers: list[subprocess.Popen] = []


def _take_server() -> subprocess.Popen:
    """An idle fork server (see ``forkserver.py``), or a new one; give it back with ``_idle.put``."""
    while True:
        try:
            proc = _idle.get_nowait()
        except queue.Empty:
            break
        if proc.poll() is None:
            return proc
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("forkserver.py"))], cwd=ROOT,
                            env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline()).get("ready"), "the fork server did not start"
    _all_servers.append(proc)
    return proc


@atexit.register
def _stop_servers() -> None:
    for proc in _all_servers:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _read_reply(proc: subprocess.Popen, deadline: float) -> dict:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
        raise subprocess.TimeoutExpired("leanml (forked)", left)
    return json.loads(proc.stdout.readline())


def run_cli(args: list[str], cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
            timeout: float = 120, fresh: bool = False) -> CliResult:
    """Run ``leanml *args`` and return its exit code, stdout and stderr.

    By default the command runs in a child forked from a process that has already imported leanml (the
    real ``leanml.cli.main`` with its own cwd, environment, output files and exit code, in milliseconds
    instead of seconds); ``fresh=True``, or an ``env`` that sets more than :data:`RUNTIME_ENV`, runs a new
    ``python -m leanml`` instead."""
    args = [str(a) for a in args]
    if fresh or set(env or {}) - RUNTIME_ENV:
        proc = subprocess.run([sys.executable, "-m", "leanml", *args], cwd=cwd, env=cli_env(env),
                              capture_output=True, text=True, timeout=timeout)
        return CliResult(proc.returncode, proc.stdout, proc.stderr)
    server = _take_server()
    with tempfile.TemporaryDirectory(prefix="leanml-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"args": args, "cwd": str(Path(cwd or os.getcwd()).absolute()),
                   "env": {"LEANML_DEBUG": "", **(env or {})}, "out": str(out), "err": str(err)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = _read_reply(server, deadline)["pid"]
        try:
            code = _read_reply(server, deadline)["code"]
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _read_reply(server, time.monotonic() + 30)
            raise
        _idle.put(server)
        return CliResult(code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def start_cli(args: list[str], cwd: str | os.PathLike | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m leanml *args`` without waiting (for signal tests); stdout/stderr are pipes.

    Ctrl-C is restored to its default in the child: a test session started in the background of a
    non-interactive shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt."""
    return subprocess.Popen([sys.executable, "-m", "leanml", *map(str, args)], cwd=cwd, env=cli_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def assert_no_traceback(result: CliResult) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, str(result)


def assert_user_error(result: CliResult, *needles: str, code: int = 2, before_work: bool = True) -> str:
    """A clean user error: exit ``code``, one ``leanml: error:`` line, no traceback; each of ``needles``
    appears in the error line. ``before_work`` (a refusal before anything ran): that line is all of
    stderr; else progress bars may come first but the error line is the last. Returns the error line."""
    assert result.code == code, str(result)
    assert_no_traceback(result)
    assert len(result.error_lines) == 1, str(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if before_work:
        assert lines == result.error_lines, str(result)
    else:
        assert lines[-1] == result.error_lines[0], str(result)
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


def save_tiny_bert(path: str | os.PathLike) -> Path:
    """A tiny random BERT encoder (what ``leanml`` must refuse) with the word-level tokenizer."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                     vocab_size=256, max_position_embeddings=128)
    BertForMaskedLM(cfg).save_pretrained(path)
    save_tiny_tokenizer(path)
    return Path(path)


def save_zeroed_copy(src: Path, dst: Path, sparsity: float = 0.5) -> Path:
    """A copy of a tiny LLaMA directory whose decoder linears lose their smallest weights (a pruned model
    for ``leanml recover``, made without running the pruner)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                w = mod.weight
                k = int(w.numel() * sparsity)
                w[w.abs() <= w.abs().flatten().kthvalue(k).values] = 0
    model.save_pretrained(dst)
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="session")
def llm_inputs(tmp_path_factory) -> Path:
    """A folder of inputs for the LLM commands: ``model/`` (tiny LLaMA), ``pruned/`` (half its decoder
    weights zero), ``bert/`` (an encoder), ``text.txt`` (UTF-8), ``latin1.txt``. Tests must not modify it."""
    root = tmp_path_factory.mktemp("llm-inputs")
    save_tiny_llama(root / "model")
    save_zeroed_copy(root / "model", root / "pruned")
    save_tiny_bert(root / "bert")
    (root / "text.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    (root / "latin1.txt").write_bytes(("Caf\u00e9 cr\u00e8me, na\u00efve fa\u00e7ade. " * 200).encode("latin-1"))
    return root


def truncated_copy(src: Path, dst: Path, name: str = "model.safetensors", keep: float = 0.6) -> Path:
    """A copy of model directory ``src`` whose file ``name`` keeps only its first ``keep`` share of bytes."""
    import shutil

    shutil.copytree(src, dst)
    data = (src / name).read_bytes()
    (dst / name).write_bytes(data[: int(len(data) * keep)])
    return dst
