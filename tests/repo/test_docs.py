"""The front door stays short and true: the README is at most 150 lines, every repository path and
dspark_rt module that it or a page of docs/ names exists, every link between them resolves, and
every DSPARK_* environment variable the code reads is listed in the README (and every one it
lists is read somewhere)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 150

# A path written in a page starts with one of these top-level names of the repository.
_TOP = r"(?:dspark_rt|csrc|tests|bench|docs|scripts|\.ci)"
_PATH = re.compile(rf"(?<![\w./~-]){_TOP}/[\w./*<>-]*")
_MODULE = re.compile(r"(?<![\w./])dspark_rt(?:\.\w+)+")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# Where the code reads an environment variable: Python, C++, shell, Makefile.
_ENV_READS = [re.compile(p, re.M) for p in (
    r"environ(?:\.get)?[(\[]\s*[\"'](DSPARK_\w+)",
    r"[\"'](DSPARK_\w+)[\"']\s+(?:not\s+)?in\s+os\.environ",
    r"getenv\(\s*[\"'](DSPARK_\w+)",
    r"\$\{?(DSPARK_\w+)",
    r"^(DSPARK_\w+)\s*\?=",
)]
_CODE = ["dspark_rt/**/*.py", "bench/*.py", "bench/*.sh", "scripts/*", "csrc/**/*.cpp",
         "csrc/**/*.cu", "csrc/**/*.cuh", "csrc/**/*.h", "setup.py", "Makefile", ".ci/*"]


def _pages():
    return [README] + DOCS


def paths_named(text: str) -> list[str]:
    """Repository paths in a page (backquoted or not); `<name>` in one stands for any name."""
    return sorted({m.rstrip(".,:;") for m in _PATH.findall(text)})


def path_exists(path: str) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", path).rstrip("/")
    return any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()


def module_exists(dotted: str) -> bool:
    """dspark_rt.a.b[.name]: the longest prefix that is a module or package exists, and the
    name after it (if any) is a word of that module's source."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        for src in (base.with_suffix(".py"), base / "__init__.py"):
            if src.is_file():
                rest = parts[n:]
                return not rest or re.search(rf"\b{re.escape(rest[0])}\b", src.read_text()) is not None
        if n == 1 or base.with_suffix(".so").exists():
            break
    return False


def broken_references(page: Path) -> list[str]:
    text = page.read_text()
    bad = [p for p in paths_named(text) if not path_exists(p)]
    bad += [m for m in sorted(set(_MODULE.findall(text))) if not module_exists(m)]
    for link in _LINK.findall(text):
        target = link.split("#")[0]
        if target and not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
            bad.append(link)
    return bad


def knobs_read() -> set[str]:
    """DSPARK_* names the code reads from the environment."""
    names = set()
    for pattern in _CODE:
        for f in ROOT.glob(pattern):
            if f.is_file() and "pretrained" not in f.parts:
                text = f.read_text(errors="replace")
                for rx in _ENV_READS:
                    names |= set(rx.findall(text))
    return names


def knobs_listed(readme: str) -> set[str]:
    """DSPARK_* names in the README's knob table (rows that start with one)."""
    return set(re.findall(r"^\| `(DSPARK_\w+)`", readme, re.M))


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines, at most {MAX_README_LINES}: move detail into docs/"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    bad = broken_references(page)
    assert not bad, f"{page.relative_to(ROOT)} names what does not exist: {bad}"


def test_the_readme_links_every_page_of_docs():
    text = README.read_text()
    missing = [d.name for d in DOCS if f"docs/{d.name}" not in text]
    assert not missing, f"README.md does not link {missing}"


def test_every_knob_the_code_reads_is_in_the_readme():
    read, listed = knobs_read(), knobs_listed(README.read_text())
    assert {"DSPARK_EXACT", "DSPARK_CUDA_PDL", "DSPARK_CUDA"} <= read  # the scan sees Python, C++, setup
    assert not read - listed, f"knobs missing from the README's table: {sorted(read - listed)}"
    assert not listed - read, f"knobs in the README that nothing reads: {sorted(listed - read)}"


def test_the_checks_catch_a_bad_path_module_link_and_knob(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See `dspark_rt/policies/nope.py`, bench/bench_<op>.py, dspark_rt.policies.NoSuchName,\n"
                    "dspark_rt.nomodule, [a link](missing.md) and `dspark_rt/policies/auto.py`.\n")
    assert broken_references(page) == ["dspark_rt/policies/nope.py", "dspark_rt.nomodule",
                                       "dspark_rt.policies.NoSuchName", "missing.md"]
    assert knobs_listed("| `DSPARK_EXACT` | 1 | x |\nDSPARK_CUDA in prose\n") == {"DSPARK_EXACT"}
