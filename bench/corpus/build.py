"""Rebuild the calibration set and the held-out domains from their offline sources (Debian packages, the Python
standard library, the licence texts Debian ships), and record each file's sha256 in bench/corpus/corpus.json.

    python bench/corpus/build.py            # needs apt-get (Debian/Ubuntu) and the man command; run from the repo

The files are committed: nothing at build or test time runs this. Sources and licences: bench/corpus/README.md.
Every file is cut from a document no other file draws on; `pipeline/corpus.py` checks that no line of a calibration
file appears in a held-out one, by hash, and the fidelity bench refuses to score otherwise.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
PACKAGES = ("debian-history", "debian-faq", "doc-debian", "manpages-fr", "manpages-de")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# standard-library modules, pure Python, each whole: the calibration's and the held-out code never share a file
CALIBRATION_CODE = ("heapq.py", "bisect.py", "colorsys.py", "queue.py", "sched.py")
HELDOUT_CODE = ("fractions.py", "textwrap.py", "graphlib.py")
# coreutils and util-linux pages, asked about in a chat (English); their French and German translations are apart
MAN_CHAT = ("ls", "cp", "mv", "rm", "mkdir", "chmod", "ln", "sort", "uniq", "head", "tail", "wc", "cut", "tr",
            "du", "df", "touch", "tee", "date", "env")
MAN_FOREIGN = {"fr": ("cat", "grep", "find", "tar", "gzip", "sed", "dd", "split"),
               "de": ("cat", "grep", "find", "tar", "gzip", "sed", "dd", "split")}
REFERENCE = dict(source="Python Language Reference (pydoc_data/topics.py, Python 3.11.7), prose only",
                 licence="PSF-2.0")
KEPT = {"python-reference.txt": dict(role="heldout", domain="technical", **REFERENCE),
        "calibration.txt": dict(role="calibration", domain="reference", **REFERENCE)}


def unpacked(work: Path) -> Path:
    """The packages' files, downloaded with apt-get and unpacked under work/root."""
    root = work / "root"
    for pkg in PACKAGES:
        subprocess.run(["apt-get", "download", pkg], cwd=work, check=True, capture_output=True)
    for deb in work.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, each joined to one line; list items keep their marker."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip()]
        if not lines:
            continue
        if lines[0].startswith("* "):
            out.append("- " + " ".join(lines)[2:])
        else:
            out.append(" ".join(lines))
    return out


def history_chapter(path: Path, start: str, end: str) -> str:
    """The text between the headings `start` and `end` of a debian-history plain-text file, as paragraphs."""
    text = gzip.open(path, "rt", encoding="utf-8").read().replace("\xa0", " ")  # no-break spaces, as typed
    body = text[text.index(start):]  # the contents list the chapters without the word
    body = body[:body.index(end)] if end in body else body
    return "\n\n".join(p for p in paragraphs(body) if not re.fullmatch(r"[-=]+", p))


def faq_conversations(path: Path) -> list[list[dict]]:
    """The Debian FAQ's numbered questions and their answers, one chat each."""
    text = gzip.open(path, "rt", encoding="utf-8").read().replace("\xa0", " ")  # no-break spaces, as typed
    text = text[text.index("\n1.1. "):]  # past the table of contents, whose entries are indented
    chats = []
    for part in re.split(r"\n(?=\d+\.\d+\. )", text):
        head, _, body = part.partition("\n")
        question = re.sub(r"^\d+\.\d+\. ", "", head).strip()
        body = re.split(r"\n(?:Chapter|Appendix) ", body)[0]  # a chapter's opening belongs to no question
        answer = "\n\n".join(paragraphs(body))
        if question.endswith("?") and len(answer.split()) >= 40:
            chats.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    return chats


def man_text(path: Path) -> str:
    """A man page rendered as plain text: no hyphenation, no justification, long lines."""
    env = {**os.environ, "MANWIDTH": "1000", "LC_ALL": "C.UTF-8"}
    out = subprocess.run(["man", "--nh", "--nj", "-l", str(path)], env=env, check=True, capture_output=True,
                         text=True).stdout
    return subprocess.run(["col", "-b"], input=out, check=True, capture_output=True, text=True, env=env).stdout


def man_sections(text: str) -> dict[str, str]:
    sections, name = {}, None
    for line in text.splitlines()[1:]:
        if line and not line[0].isspace():
            name = line.strip()
            sections[name] = []
        elif name is not None:
            sections[name].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def man_chat(path: Path, command: str) -> list[dict]:
    """A question about a command and its man page's name, synopsis and description as the answer."""
    s = list(man_sections(man_text(path)).values())
    name, synopsis, description = (paragraphs(s[i]) for i in range(3))
    command_names, _, what = name[0].partition(" - ")
    answer = [f"`{command_names}`: {what}.", "Usage: `" + " ".join(synopsis) + "`"]
    answer += ["- " + p if p.startswith("-") else p for p in description[:14]]
    return [{"role": "user", "content": f"What does the `{command}` command do, and which options does it take?"},
            {"role": "assistant", "content": "\n\n".join(answer)}]


def man_foreign(root: Path, lang: str, commands: tuple[str, ...]) -> str:
    """The description sections of translated man pages, one after another."""
    out = []
    for cmd in commands:
        page = next((root / "usr/share/man" / lang).glob(f"man1/{cmd}.1*"))
        s = list(man_sections(man_text(page)).values())
        out.append("\n\n".join(paragraphs(s[0]) + paragraphs(s[2])[:10]))
    return "\n\n".join(out)


def code(names: tuple[str, ...]) -> str:
    return "\n\n".join(f"# {name}\n" + (STDLIB / name).read_text() for name in names)


def licence(name: str) -> str:
    return Path("/usr/share/common-licenses", name).read_text()


def tables() -> str:
    """Tables and numbers: the IANA port list Debian's netbase ships, and the time zone table of tzdata."""
    services = [ln for ln in Path("/etc/services").read_text().splitlines() if ln and not ln.startswith("#")]
    zones = [ln for ln in Path("/usr/share/zoneinfo/zone1970.tab").read_text().splitlines()
             if ln and not ln.startswith("#")]
    return "\n".join(services[:200]) + "\n\n" + "\n".join(zones[:160]) + "\n"


def write(rel: str, text: str, files: dict, **meta) -> None:
    import hashlib
    path = HERE / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.strip() + "\n"
    path.write_text(data, encoding="utf-8")
    files[rel] = {**meta, "sha256": hashlib.sha256(data.encode()).hexdigest()}


def main() -> None:
    files: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = unpacked(Path(tmp))
        doc = root / "usr/share/doc"
        history = doc / "debian-history/docs"
        chat = lambda convs: json.dumps(convs, indent=1, ensure_ascii=False)  # noqa: E731
        # held out: scored, never calibrated on
        write("heldout/narrative.txt", history_chapter(history / "project-history.en.txt.gz",
                                                       "Chapter 4.", "Appendix A."), files,
              role="heldout", domain="narrative", source="debian-history 2.28, A Brief History of Debian, chapter 4",
              licence="GPL-2+")
        write("heldout/french.txt", history_chapter(history / "project-history.fr.txt.gz",
                                                    "Chapitre 4.", "Annexe A."), files,
              role="heldout", domain="french", source="debian-history 2.28, Bref historique de Debian, chapitre 4",
              licence="GPL-2+")
        write("heldout/chat.json", chat(faq_conversations(doc / "debian/FAQ/debian-faq.en.txt.gz")), files,
              role="heldout", domain="chat",
              source="debian-faq 11.1, The Debian GNU/Linux FAQ: its questions and answers",
              licence="verbatim and modified copies permitted (see the package's copyright)")
        write("heldout/code.txt", code(HELDOUT_CODE), files, role="heldout", domain="code",
              source="CPython 3.11.7 standard library: " + ", ".join(HELDOUT_CODE), licence="PSF-2.0")
        write("heldout/legal.txt", licence("GPL-3"), files, role="heldout", domain="legal",
              source="GNU General Public License version 3 (/usr/share/common-licenses/GPL-3)",
              licence="verbatim copies permitted")
        # the calibration set
        write("calibration/code.txt", code(CALIBRATION_CODE), files, role="calibration", domain="code",
              source="CPython 3.11.7 standard library: " + ", ".join(CALIBRATION_CODE), licence="PSF-2.0")
        write("calibration/legal.txt", licence("Apache-2.0") + "\n\n" + licence("MPL-2.0"), files,
              role="calibration", domain="legal", source="Apache License 2.0 and Mozilla Public License 2.0",
              licence="verbatim copies permitted")
        write("calibration/essays.txt", "\n\n".join(
            "\n\n".join(paragraphs(gzip.open(doc / "debian" / name, "rt").read()))
            for name in ("debian-manifesto.gz", "social-contract.txt.gz")), files,
              role="calibration", domain="essay", source="doc-debian 11.3: the Debian Manifesto, the Social Contract",
              licence="GPL-2+")
        write("calibration/chat.json", chat([man_chat(next(Path("/usr/share/man/man1").glob(f"{c}.1*")), c)
                                             for c in MAN_CHAT]), files,
              role="calibration", domain="chat", source="coreutils man pages: " + ", ".join(MAN_CHAT),
              licence="GPL-3+")
        write("calibration/tables.txt", tables(), files, role="calibration", domain="tables",
              source="netbase /etc/services, tzdata zone1970.tab", licence="GPL-2 (netbase), public domain (tzdata)")
        for lang, cmds in MAN_FOREIGN.items():
            write(f"calibration/{lang}.txt", man_foreign(root, lang, cmds), files, role="calibration",
                  domain="french" if lang == "fr" else "german",
                  source=f"manpages-{lang} 4.18.1: " + ", ".join(cmds), licence="GPL-3+")
    for rel, meta in KEPT.items():  # the files of the first corpus, kept as they are
        write(rel, (HERE / rel).read_text(), files, **meta)
    (HERE / "corpus.json").write_text(json.dumps(files, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: v["sha256"][:12] for k, v in files.items()}, indent=1))


if __name__ == "__main__":
    main()
