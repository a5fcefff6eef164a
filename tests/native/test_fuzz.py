"""Hostile input: damaged .pte files, damaged tokenizer.json files and bad interactive input, run through both
runners built with AddressSanitizer + UBSan (native/build.sh --sanitize -> native/build-asan/).

Every run must end with exit 0 or exit 1 (exit 1 with an "error:" message on stderr): never a signal, never a
hang (a timeout), never a sanitizer report. Each test prints a count table per family of damage. The damage is
drawn from seeded RNGs, so a failing case is reproduced by its name (family and index) and FUZZ_SEED.
"""
from __future__ import annotations

import bisect
import fcntl
import json
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import pte_layout

# The slow tier (the sanitizer build alone is ~70 s); CI keeps the release runners' checks on damaged programs
# (test_program_integrity.py)
pytestmark = pytest.mark.slow
ROTATION_HEAVY = True  # the sanitizer build: a share of the slow tier's rotation of its own

REPO = Path(__file__).resolve().parents[2]
NATIVE = REPO / "native"
ASAN_BUILD = NATIVE / "build-asan"
SEED = int(os.environ.get("FUZZ_SEED", "20261201"))
TIMEOUT = 60  # s per run; a hang is a failure
WORKERS = 2  # the machine has 2 cores; each runner gets --threads 1
# Leak checking stays on: the uninstrumented ExecuTorch libraries showed no leak reports (their heap goes
# through ASan's malloc too). A huge allocation fails as in the Release build (std::bad_alloc -> exit 1)
# instead of being an ASan report.
SAN_ENV = {"ASAN_OPTIONS": "detect_leaks=1:allocator_may_return_null=1:abort_on_error=1",
           "UBSAN_OPTIONS": "print_stacktrace=1"}
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "SUMMARY: ")


# ---------------------------------------------------------------------------------------------------------------
# the sanitizer build and the run bookkeeping

@pytest.fixture(scope="session")
def asan_bins() -> tuple[Path, Path]:
    """(llm_runner, llm_batched_runner) with ASan + UBSan; ninja makes it a no-op when nothing changed."""
    ASAN_BUILD.mkdir(parents=True, exist_ok=True)
    with open(ASAN_BUILD / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(["bash", str(NATIVE / "build.sh"), "--sanitize"], capture_output=True, text=True,
                              env=dict(os.environ, PYTHON=sys.executable))
    if proc.returncode != 0:
        pytest.fail("sanitizer build failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:]))
    return ASAN_BUILD / "llm_runner", ASAN_BUILD / "llm_batched_runner"


@dataclass
class Case:
    family: str  # the row of the table
    name: str  # family/index: reproducible with the same seed
    argv: list
    stdin: bytes | None = None
    documented: int = 0  # damage draws redrawn out of the documented loader-crash ranges


@dataclass
class Outcome:
    case: Case
    code: int | None  # None: timed out
    stderr: str
    problems: list = field(default_factory=list)


def run_case(case: Case) -> Outcome:
    env = dict(os.environ, **SAN_ENV)
    try:
        proc = subprocess.run([str(a) for a in case.argv], input=case.stdin if case.stdin is not None else b"",
                              capture_output=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode(errors="replace")
        return Outcome(case, None, err, [f"hang: no exit within {TIMEOUT} s"])
    err = proc.stderr.decode(errors="replace")
    out = Outcome(case, proc.returncode, err)
    if proc.returncode < 0:
        out.problems.append(f"killed by signal {-proc.returncode}")
    elif proc.returncode not in (0, 1):
        out.problems.append(f"exit {proc.returncode} (expected 0 or 1)")
    elif proc.returncode == 1 and "error:" not in err:
        out.problems.append("exit 1 without an 'error:' message")
    if any(m in err for m in SANITIZER_MARKS):
        out.problems.append("sanitizer report")
    return out


def run_all(cases: list[Case]) -> list[Outcome]:
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(run_case, cases))


def report(title: str, outcomes: list[Outcome]) -> dict:
    """Prints the count table (a row per family and a total) and returns the totals."""
    families = list(dict.fromkeys(o.case.family for o in outcomes))
    cols = ("cases", "exit 0", "exit 1", "signals", "hangs", "sanitizer", "documented")

    def counts(rows):
        return {"cases": len(rows), "exit 0": sum(o.code == 0 for o in rows),
                "exit 1": sum(o.code == 1 for o in rows), "signals": sum(o.code is not None and o.code < 0 for o in rows),
                "hangs": sum(o.code is None for o in rows),
                "sanitizer": sum("sanitizer report" in o.problems for o in rows),
                "documented": sum(o.case.documented for o in rows)}

    width = max(len(f) for f in families + ["total"])
    lines = [f"\n{title}", f"{'':{width}}  " + "  ".join(f"{c:>9}" for c in cols)]
    for fam in families + ["total"]:
        rows = outcomes if fam == "total" else [o for o in outcomes if o.case.family == fam]
        c = counts(rows)
        lines.append(f"{fam:{width}}  " + "  ".join(f"{c[k]:>9}" for k in cols))
    print("\n".join(lines))
    for o in outcomes:
        if o.problems:
            tail = "\n    ".join(o.stderr.strip().splitlines()[-25:])
            print(f"FAIL {o.case.name}: {', '.join(o.problems)}\n  argv: {' '.join(map(str, o.case.argv))}\n    {tail}")
    return counts(outcomes)


def check(title: str, outcomes: list[Outcome]) -> None:
    totals = report(title, outcomes)
    failed = [f"{o.case.name}: {', '.join(o.problems)}" for o in outcomes if o.problems]
    assert totals["signals"] == 0 and totals["sanitizer"] == 0 and not failed, "\n".join(failed)


# ---------------------------------------------------------------------------------------------------------------
# damaged programs

# The documented loader crash (native/README.md, "Known loader crashes"; tests/native/repro_loader_crash.py): the
# dims of a non-constant XNNPACK tensor value size XNNPACK's workspace unchecked, so an enlarged dim makes
# xnn_plan_memory ask for gigabytes and the process is killed when it runs out of memory. A random byte
# drawn inside those ranges is drawn again, and counted in the table's "documented" column.
DOCUMENTED = "XNNPACK activation dims (Known loader crashes)"


class Damager:
    """Seeded damage of one program: overwritten bytes, zeroed ranges, truncations. Overwrites never land in the
    documented ranges (they are redrawn and counted); zeroing and truncating cannot enlarge a dim."""

    def __init__(self, data: bytes, rng: random.Random):
        self.data, self.rng = data, rng
        self.fb_end, self.seg_base = pte_layout.layout(data)
        self.documented = pte_layout.activation_dims_ranges(data)
        self.redrawn = 0

    def _in_documented(self, pos: int) -> bool:
        i = bisect.bisect_right(self.documented, (pos, float("inf"))) - 1
        return i >= 0 and self.documented[i][0] <= pos < self.documented[i][1]

    def _offset(self, lo: int, hi: int) -> int:
        while True:
            pos = self.rng.randrange(lo, hi)
            if not self._in_documented(pos):
                return pos
            self.redrawn += 1

    def overwrite(self, lo: int, hi: int) -> bytes:
        """1 to 8 random bytes at random offsets in [lo, hi)."""
        b = bytearray(self.data)
        for _ in range(self.rng.randint(1, 8)):
            b[self._offset(lo, hi)] = self.rng.randrange(256)
        return bytes(b)

    def zero_range(self, lo: int, hi: int) -> bytes:
        start = self.rng.randrange(lo, hi)
        n = min(self.rng.choice((4, 16, 64, 256, 4096)), len(self.data) - start)
        return self.data[:start] + bytes(n) + self.data[start + n:]

    def shorten(self, call: tuple[int, int, str]) -> bytes:
        pos, n, _ = call
        return self.data[:pos] + self.rng.randrange(n).to_bytes(4, "little") + self.data[pos + 4:]

    def truncate(self) -> bytes:
        # half of the cuts inside the flatbuffer (where the loader reads first), half anywhere
        end = self.rng.randrange(0, self.fb_end) if self.rng.random() < 0.5 else self.rng.randrange(0, len(self.data))
        return self.data[:end]

    def variants(self, counts: dict) -> list[tuple[str, bytes, int]]:
        """(family, damaged copy, draws redrawn out of the documented ranges) per variant."""
        size, out = len(self.data), []
        regions = {"header": (0, 32), "flatbuffer": (32, self.fb_end), "segments": (self.seg_base, size),
                   "anywhere": (0, size)}
        for family, (lo, hi) in regions.items():
            for _ in range(counts[family]):
                before = self.redrawn
                out.append((f"overwrite {family}", self.overwrite(lo, hi), self.redrawn - before))
        graphs = pte_layout.xnnpack_graphs(self.data)
        for _ in range(counts.get("xnnpack", 0)):  # inside the XNNPACK delegate graphs (their own flatbuffers)
            before = self.redrawn
            out.append(("overwrite XNNPACK graphs", self.overwrite(*self.rng.choice(graphs)), self.redrawn - before))
        calls = [c for c in pte_layout.call_args(self.data) if c[1] > 0]
        for _ in range(counts.get("short_args", 0)):  # a call handed fewer arguments than its kernel takes
            out.append(("shorten a call's arguments", self.shorten(self.rng.choice(calls)), 0))
        for _ in range(counts["truncate"]):
            out.append(("truncate", self.truncate(), 0))
        for _ in range(counts["zero"]):
            lo, hi = (32, self.fb_end) if self.rng.random() < 0.6 else (self.seg_base, size)
            out.append(("zero a range", self.zero_range(lo, hi), 0))
        return out


PTE_COUNTS = {"header": 10, "flatbuffer": 80, "segments": 30, "anywhere": 20, "xnnpack": 40, "short_args": 15,
              "truncate": 25, "zero": 30}
OG_COUNTS = {"header": 5, "flatbuffer": 40, "segments": 10, "anywhere": 10, "xnnpack": 20, "short_args": 15,
             "truncate": 10, "zero": 10}


def program_cases(tmp: Path, stem: str, data: bytes, rng: random.Random, counts: dict, label: str, argv) -> list[Case]:
    cases = []
    for i, (family, blob, redrawn) in enumerate(Damager(data, rng).variants(counts)):
        p = tmp / f"{stem}_{i:03d}.pte"
        p.write_bytes(blob)
        cases.append(Case(f"{label}: {family}", f"pte/{stem}/{i}", argv(p, i), documented=redrawn))
    return cases


def test_damaged_programs(asan_bins, tiny_programs, og_programs, tmp_path):
    llm_runner, batched = asan_bins
    rng = random.Random(SEED)
    # llm_runner: the in-graph 8da4w program (XNNPACK delegate blobs, quantized kernels)
    cases = program_cases(tmp_path, "q8", (tiny_programs / "tiny_8da4w.pte").read_bytes(), rng, PTE_COUNTS,
                          "llm_runner 8da4w",
                          lambda p, i: [llm_runner, "--pte", p, "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                                        "--threads", "1"])
    # llm_batched_runner: the off-graph program (the runtime-owned cache and its custom kernel)
    cases += program_cases(tmp_path, "og", (og_programs / "og_llama.pte").read_bytes(), rng, OG_COUNTS,
                           "batched offgraph",
                           lambda p, i: [batched, "--pte", p, "--ids", "--cache-kind",
                                         ("batched-sequence", "batched-cell")[i % 2], "--max-new-tokens", "2",
                                         "--threads", "1", "1,2,3", "4,5"])
    check(f"damaged programs (seed {SEED}; '{DOCUMENTED}': draws redrawn)", run_all(cases))


# ---------------------------------------------------------------------------------------------------------------
# damaged tokenizers: two small valid bases (under 128 ids, so they fit the off-graph program's vocabulary too)

def _gpt2_char(b: int) -> str:
    """GPT-2's byte-to-unicode map for the bytes the byte-level base uses."""
    return chr(b) if 33 <= b <= 126 else chr(256 + b)  # space -> U+0120, newline -> U+010A


def byte_level_tokenizer() -> dict:
    """GPT-2 / SmolLM2 style: Split(regex) + ByteLevel, merges, ChatML specials, a BOS template."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in [32, 10, *range(33, 127)]:
        vocab[_gpt2_char(b)] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("Ġ", "a"), ("o", "n"),
              ("r", "e"), ("Ġ", "s"), ("e", "n"), ("Ġ", "w"), ("Ġ", "c"), ("o", "r"), ("Ġw", "or"), ("l", "d"),
              ("Ġwor", "ld"), ("Ġc", "a"), ("Ġca", "t"), ("Ġa", "n"), ("Ġan", "d")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) < 128
    pattern = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(specials)],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                             "tokens": ["<|endoftext|>"]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


def sentencepiece_tokenizer() -> dict:
    """Llama-2 / Gemma style: Replace normalizer, unk, Replace + ByteFallback + Fuse + Strip decoder, pair merges."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in "▁" + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789" + ".,!?'é":
        vocab[ch] = len(vocab)
    vocab.update({f"<0x{b:02X}>": len(vocab) + k for k, b in enumerate((0x0A, 0xE2, 0x82, 0xAC))})
    merges = [["▁", "t"], ["h", "e"], ["▁t", "he"], ["i", "n"], ["▁", "a"], ["e", "r"], ["o", "n"], ["▁", "w"]]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) < 128
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(specials)]
        + [{"id": vocab["▁the"], "content": "the end", "single_word": True, "lstrip": True, "rstrip": False,
            "normalized": True, "special": False}],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [], "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def dump(tok: dict) -> bytes:
    return json.dumps(tok, ensure_ascii=False, indent=1).encode()


def flip_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xc1\xbf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80",
                b"\xf8\x88\x80\x80\x80", b"\x80", b"\xbf\xbf", b"\xe2\x82", b"\xf0\x9f\x98", b"\xe2\x82\xac\x80"]


def invalid_utf8(data: bytes, rng: random.Random) -> bytes:
    """An invalid UTF-8 sequence inside a JSON string: a vocab key (the fast scanner), or any other string."""
    quotes = [i for i, c in enumerate(data) if c == ord('"')]
    at = rng.choice(quotes) + 1  # just after an opening or closing quote
    return data[:at] + rng.choice(INVALID_UTF8) + data[at:]


def nested(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "]" * depth
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    # a Sequence of Sequences: the tokenizer's own recursion, not the JSON parser's
    return '{"type":"Sequence","normalizers":[' * depth + '{"type":"Prepend","prepend":"x"}' + "]}" * depth


def deep_nesting(tok: dict, rng: random.Random, i: int) -> bytes:
    depth = rng.choice((1000, 100_000, 1_000_000))
    kind = ("array", "object", "sequence")[i % 3]
    text = dump(tok).decode()
    where = i % 4
    if kind == "sequence":
        return text.replace('"normalizer": ', '"normalizer": ' + nested(depth, kind) + ', "x": ', 1).encode()
    if where == 0:  # a key the scanner skips
        return text.replace('"truncation": null', '"truncation": ' + nested(depth, kind), 1).encode()
    if where == 1:  # inside model, next to vocab and merges
        return text.replace('"dropout": null', '"dropout": ' + nested(depth, kind), 1).encode()
    if where == 2:  # as the value of a vocab entry (the fast scanner)
        return text.replace('"<|endoftext|>": 0', '"<|endoftext|>": ' + nested(depth, kind), 1).replace(
            '"<pad>": 0', '"<pad>": ' + nested(depth, kind), 1).encode()
    return text.replace('"added_tokens": [', '"added_tokens": [' + nested(depth, kind) + ",", 1).encode()


HUGE = ["1e400", "-1e400", "99999999999999999999999999", "-99999999999999999999", "4294967296", "2147483648",
        "-2147483649", "1073741824", "1099511627776", "9223372036854775808", "1e30", "-1", "0.5", "1.7976931348623157e308",
        "1" * 400]


def huge_number(tok: dict, rng: random.Random, i: int) -> bytes:
    """A huge (or negative, or fractional) number where the tokenizer reads an integer."""
    n = rng.choice(HUGE)
    text = dump(tok).decode()
    targets = [('"id": 2,', f'"id": {n},'),  # an added token's id
               ('": 5,', f'": {n},'),  # a vocab id
               ('"ids": [', f'"ids": [{n}, '),  # a template's special token ids
               ('"start": 1', f'"start": {n}'),  # the Strip decoder (sentencepiece base)
               ('"stop": 0', f'"stop": {n}'),
               ('"dropout": null', f'"dropout": {n}'),
               ('"type_id": 0', f'"type_id": {n}')]
    old, new = targets[i % len(targets)]
    return text.replace(old, new, 1).encode()


def structural(tok: dict, i: int) -> bytes:
    """Valid JSON with the wrong shapes: the types the loader trusts."""
    t = json.loads(json.dumps(tok))
    edits = [
        lambda t: t["model"].__setitem__("vocab", list(t["model"]["vocab"])),
        lambda t: t["model"].__setitem__("merges", {"a": "b"}),
        lambda t: t["model"].__setitem__("merges", [["a"], ["b", "c", "d"], 5, None]),
        lambda t: t["model"].__setitem__("merges", ["nospace", "a b c", " ", ""]),
        lambda t: t.__setitem__("model", None),
        lambda t: t.__setitem__("model", {"type": "WordPiece", "vocab": {}}),
        lambda t: t["model"].__setitem__("vocab", {}),
        lambda t: t["model"].__setitem__("vocab", {k: 0 for k in t["model"]["vocab"]}),  # every id 0
        lambda t: t["model"].__setitem__("vocab", {"a": 5, "b": 1 << 30}),  # sparse: a huge id, few entries
        lambda t: t.__setitem__("added_tokens", [{"id": 7}, {"content": 5, "id": "x"}]),
        lambda t: t.__setitem__("added_tokens", [{"id": 1 << 31, "content": "big"}]),
        lambda t: t.__setitem__("added_tokens", [{"id": (1 << 31) - 1, "content": "big"}]),
        lambda t: t.__setitem__("added_tokens", [{"id": 3, "content": ""}]),  # an empty added token
        lambda t: t.__setitem__("normalizer", {"type": "Replace", "pattern": {"Regex": "(("}, "content": "x"}),
        lambda t: t.__setitem__("normalizer", {"type": "Replace", "pattern": {"String": ""}, "content": "xx"}),
        lambda t: t.__setitem__("pre_tokenizer", {"type": "Split", "pattern": {"Regex": "(a*)*b"},
                                                  "behavior": "Isolated", "invert": False}),
        lambda t: t.__setitem__("pre_tokenizer", {"type": "Split", "pattern": {"Regex": ""},
                                                  "behavior": "Removed", "invert": True}),
        lambda t: t.__setitem__("pre_tokenizer", {"type": "Split", "pattern": 7, "behavior": 3}),
        lambda t: t.__setitem__("decoder", {"type": "Strip", "content": "", "start": 2147483647, "stop": 2147483647}),
        lambda t: t.__setitem__("decoder", {"type": "Replace", "pattern": {"String": ""}, "content": "x"}),
        lambda t: t.__setitem__("post_processor", {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "nope"}}]}),
        lambda t: t.__setitem__("post_processor", {"type": "TemplateProcessing", "single": 3}),
        lambda t: t.__setitem__("post_processor", {"type": "BertProcessing", "cls": ["[CLS]"], "sep": 5}),
        lambda t: t.__setitem__("post_processor", {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "s"}}], "special_tokens": {"s": {"ids": [-5, 1 << 30]}}}),
        lambda t: t.__setitem__("pre_tokenizer", {"type": "Metaspace", "replacement": "", "prepend_scheme": "always"}),
        lambda t: t.__setitem__("decoder", {"type": "Metaspace", "replacement": "", "prepend_scheme": "always"}),
        lambda t: t.__setitem__("added_tokens", t["added_tokens"] + [{"id": 3, "content": "x" * 100_000}]),
        lambda t: t["model"].__setitem__("unk_token", "not-in-vocab"),
        lambda t: t["model"].__setitem__("byte_fallback", "yes"),
    ]
    edits[i % len(edits)](t)
    return json.dumps(t).encode()


def tokenizer_variants(rng: random.Random) -> list[tuple[str, bytes]]:
    bases = [byte_level_tokenizer(), sentencepiece_tokenizer()]
    out = []
    for i in range(24):
        out.append(("bytes flipped", flip_bytes(dump(bases[i % 2]), rng)))
    for i in range(14):
        data = dump(bases[i % 2])
        out.append(("truncated", data[:rng.randrange(len(data))]))
    for i in range(14):
        out.append(("invalid UTF-8", invalid_utf8(dump(bases[i % 2]), rng)))
    for i in range(12):
        out.append(("deep nesting", deep_nesting(bases[i % 2], rng, i)))
    for i in range(16):
        out.append(("huge numbers", huge_number(bases[i % 2], rng, i)))
    for i in range(29):
        out.append(("wrong shapes", structural(bases[i % 2], i)))
    return out


def test_damaged_tokenizers(asan_bins, tiny_programs, og_programs, tmp_path):
    llm_runner, batched = asan_bins
    rng = random.Random(SEED + 1)
    q8 = tiny_programs / "tiny_8da4w.pte"
    og = og_programs / "og_llama.pte"
    prompt = "Hello world, the cat and 12 cats!\nthe end é €"
    cases = []
    for i, (family, blob) in enumerate(tokenizer_variants(rng)):
        p = tmp_path / f"tok_{i:03d}.json"
        p.write_bytes(blob)
        chat = "chatml" if i % 3 == 0 else "0"
        cases.append(Case("llm_runner: " + family, f"tok/{i}/llm_runner",
                          [llm_runner, "--pte", q8, "--tokenizer", p, "--prompt", prompt, "--chat", chat,
                           "--max-new-tokens", "3", "--threads", "1"]))
        cases.append(Case("batched: " + family, f"tok/{i}/batched",
                          [batched, "--pte", og, "--tokenizer", p, "--chat", chat, "--max-new-tokens", "3",
                           "--threads", "1", prompt, "the world"]))
    check(f"damaged tokenizers (seed {SEED + 1})", run_all(cases))


def test_valid_tokenizer_bases_run(asan_bins, tiny_programs, tmp_path):
    """The undamaged bases load and generate in both runners (else every damaged case would only test
    the first check that fails)."""
    llm_runner, _ = asan_bins
    for i, tok in enumerate((byte_level_tokenizer(), sentencepiece_tokenizer())):
        p = tmp_path / f"base_{i}.json"
        p.write_bytes(dump(tok))
        proc = subprocess.run([llm_runner, "--pte", tiny_programs / "tiny_8da4w.pte", "--tokenizer", p, "--prompt",
                               "Hello world, the cat", "--max-new-tokens", "3"], capture_output=True, text=True,
                              errors="replace", timeout=TIMEOUT, env=dict(os.environ, **SAN_ENV))
        assert proc.returncode == 0, proc.stderr
        assert "STATS_JSON" in proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# bad interactive input (llm_runner --interactive): invalid UTF-8, NUL bytes, a 1 MB line

def interactive_inputs(rng: random.Random) -> list[tuple[str, bytes]]:
    lines = []
    for seq in INVALID_UTF8:
        lines.append(("invalid UTF-8", b"Hello " + seq + b" world\n" + seq + b"\n/undo\n"))
    lines.append(("invalid UTF-8", bytes(rng.randrange(128, 256) for _ in range(4096)) + b"\n"))
    lines.append(("invalid UTF-8", b"ends in a partial character \xe2\x82"))  # no newline at the end
    for nul in (b"\x00", b"a\x00b\x00c", b"\x00" * 1000, b"/undo\x00 2", b"/reset\x00", b"/quit\x00"):
        lines.append(("NUL bytes", nul + b"\nHello\n"))
    lines.append(("NUL bytes", bytes(rng.randrange(0, 32) for _ in range(2000)) + b"\r\n\r\n"))
    mb = 1 << 20
    lines.append(("1 MB line", b"word " * (mb // 5) + b"\nHello\n"))
    lines.append(("1 MB line", b"a" * mb + b"\n"))  # one 1 MB word: the BPE merge loop on a single word
    lines.append(("1 MB line", bytes(rng.randrange(32, 127) for _ in range(mb)) + b"\n"))
    lines.append(("1 MB line", "é€😀 ".encode() * (mb // 12) + b"\n"))
    lines.append(("1 MB line", bytes(rng.randrange(256) for _ in range(mb)) + b"\n/undo 1\nHello\n"))
    for cmd in (b"/undo 99999999999999999999999", b"/undo -3", b"/undo 0x10", b"/undo " + b"9" * 5000, b"/reset /reset",
                b"/" * 1000):
        lines.append(("commands", b"Hello\n" + cmd + b"\nHello again\n"))
    return lines


def test_interactive_input(asan_bins, tiny_programs, tmp_path):
    llm_runner, _ = asan_bins
    rng = random.Random(SEED + 2)
    cases = []
    for i, tok in enumerate((byte_level_tokenizer(), sentencepiece_tokenizer())):
        p = tmp_path / f"base_{i}.json"
        p.write_bytes(dump(tok))
        for k, (family, stdin) in enumerate(interactive_inputs(rng)):
            chat = ("chatml", "0")[k % 2]
            cases.append(Case(f"interactive: {family}", f"interactive/{i}/{k}",
                              [llm_runner, "--pte", tiny_programs / "tiny_8da4w.pte", "--tokenizer", p, "--chat", chat,
                               "--interactive", "--max-new-tokens", "2", "--threads", "1"], stdin=stdin))
    check(f"bad interactive input (seed {SEED + 2})", run_all(cases))
