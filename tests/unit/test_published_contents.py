"""What a published package or a ComfyUI-Manager scan of the repository sees: the runtime, the web
extension and the workflows, and one node."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_TOP_LEVEL = {"__init__.py", "nodes", "kernels", "web", "workflows", "pyproject.toml", "requirements.txt",
                     "README.md", "LICENSE", "node_list.json"}


def repo_files() -> list[str]:
    """Tracked files plus new ones git does not ignore (a directory walk sees those too, so a
    restructure's new modules are checked before their commit); files gone from the work tree are left out."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return sorted({line for line in out.splitlines() if line and (ROOT / line).is_file()})


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".comfyignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    # gitwildmatch as comfy-cli applies it, for the forms used here: "/dir/" (at the root only), "dir/" (a folder
    # of that name anywhere) and file names
    for p in patterns:
        if p.startswith("/") and p.endswith("/"):
            if path.startswith(p[1:]):
                return True
            continue
        if p.endswith("/") and (path.startswith(p) or f"/{p}" in f"/{path}"):
            return True
        if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(Path(path).name, p):
            return True
    return False


def shipped_files(files=None) -> list[str]:
    patterns = ignore_patterns()
    return [f for f in (repo_files() if files is None else files) if not ignored(f, patterns)]


def test_published_archive_holds_only_the_runtime_web_and_workflows():
    shipped = shipped_files()
    tops = {f.split("/", 1)[0] for f in shipped}
    assert tops <= SHIPPED_TOP_LEVEL, f"would ship: {sorted(tops - SHIPPED_TOP_LEVEL)}"
    assert {"__init__.py", "nodes", "kernels", "web", "workflows"} <= tops
    assert not [f for f in shipped if f.startswith(("tests/", "benchmarks/", "devkit/", "scripts/"))]


# The patterns ComfyUI-Manager's scanner applies to every .py file of a repository, plus its node_list.json.
MAPPING_PATTERNS = [r"_CLASS_MAPPINGS\s*=\s*{", r"^[^=]*_CLASS_MAPPINGS\[[\"']", r"@register_node\("]


def test_the_nodes_help_page_ships_and_the_repositorys_docs_do_not():
    """ComfyUI's node docs panel reads WEB_DIRECTORY/docs/<node id>.md from the installed pack."""
    shipped = shipped_files()
    assert "web/docs/SageStridedNHDAttention.md" in shipped
    assert not [f for f in shipped if f.startswith("docs/")], "the repository's docs/ would ship"
    assert ignored("web/docs/x.md", ["docs/"]) and not ignored("web/docs/x.md", ["/docs/"])
    assert ignored("docs/BENCHMARKS.md", ["/docs/"])


def test_a_manager_scan_credits_the_pack_with_its_one_node():
    hits = []
    for f in repo_files():
        if f.endswith(".py"):
            text = (ROOT / f).read_text(encoding="utf-8")
            hits += [f for p in MAPPING_PATTERNS if re.search(p, text, re.MULTILINE)]
    assert hits == [], f"a scan would credit the pack with node mappings in {sorted(set(hits))}"
    listed = json.loads((ROOT / "node_list.json").read_text())
    assert list(listed) == ["SageStridedNHDAttention"]


def imported_top_levels(path: str) -> set[str]:
    """The repository-level names a module imports: absolute imports by their first component, relative
    ones resolved against the module's package (``from .. import x`` in kernels/backends/ -> kernels)."""
    package = path.split("/")[:-1]
    names = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.add(node.module.split(".")[0])
                continue
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            target = base + (node.module.split(".") if node.module else [])
            names |= {target[0]} if target else {alias.name.split(".")[0] for alias in node.names}
    return names


def test_the_shipped_runtime_imports_nothing_that_is_left_out():
    """The oracle, the benchmarks' helpers and the tests stay out of the archive, so no shipped module may
    import them (the sage2 oracle moved from kernels/ to devkit/ for this reason)."""
    files = repo_files()
    shipped = shipped_files(files)
    left_out = {f.split("/", 1)[0] for f in files if "/" in f} - {f.split("/", 1)[0] for f in shipped}
    assert {"devkit", "tests", "benchmarks"} <= left_out
    offenders = {f: sorted(imported_top_levels(f) & left_out) for f in shipped if f.endswith(".py")}
    offenders = {f: names for f, names in offenders.items() if names}
    assert offenders == {}, f"shipped modules importing what is not shipped: {offenders}"
    assert "devkit/sage2_oracle.py" in files and not any(f.endswith("sage2_quant_ref.py") for f in shipped)


def test_imported_top_levels_resolves_relative_imports():
    assert imported_top_levels("kernels/backends/sage2.py") >= {"kernels", "torch"}
    assert "devkit" in imported_top_levels("devkit/sage2_oracle.py")


# --- README.md: what a user reads on GitHub, on the Comfy Registry's page and in ComfyUI-Manager ------------------------
README = ROOT / "README.md"
REPO_BLOB = "https://github.com/comfyui-sage-strided-nhd/comfyui-sage-strided-nhd/blob/main/"
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)  # inline, and reference definitions


def readme_lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def test_readme_is_short_with_no_long_line():
    lines = readme_lines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"


def test_readme_links_work_without_docs():
    """A Comfy Registry install has no docs/ (.comfyignore), so links into docs/ are absolute, to files that exist;
    a relative link must point at a file that ships."""
    links = [inline or defined for inline, defined in MARKDOWN_LINK.findall(README.read_text(encoding="utf-8"))]
    shipped = set(shipped_files())
    for link in links:
        if link.startswith("#"):
            continue
        if link.startswith(REPO_BLOB):
            path = link[len(REPO_BLOB):].split("#", 1)[0].split("?", 1)[0]  # "?raw=true": GitHub's image form
            assert (ROOT / path).is_file(), f"README links to {link}, but {path} is not in the repository"
        elif "://" not in link:
            path = link.split("#", 1)[0]
            assert path in shipped, f"README's relative link {link} points at a file a Registry install lacks"
    assert any(link.startswith(REPO_BLOB + "docs/") for link in links), "README should link the docs by absolute URL"


def test_readme_names_the_commands_ci_runs():
    """The README's development block is the two commands, and CI (.ci/run) runs exactly those."""
    text = README.read_text(encoding="utf-8")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("bash scripts/")]
    assert ci == ["bash scripts/setup.sh", "bash scripts/test.sh"], ci
    for command in ci:
        assert re.search(rf"^{re.escape(command)}\s", text, re.MULTILINE), f"README lacks `{command}`"
        assert (ROOT / command.split()[1]).is_file()


def test_readme_lists_the_bundled_templates_by_their_names():
    """The table under "Use" names each template as the template browser shows it (its file name), the strided
    templates first, their HND twins (the A/B baseline) after them."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([^`]+)` \|", section, re.MULTILINE)
    names = {p.stem for p in (ROOT / "workflows").glob("*.json")}
    assert set(listed) == names, f"README's templates {sorted(listed)} != workflows/ {sorted(names)}"
    assert [n.endswith("strided NHD") for n in listed] == [True, True, False, False], listed


def test_readme_shows_the_chart_and_leaves_the_reference_to_the_help_page():
    text = README.read_text(encoding="utf-8")
    assert re.search(r"^!\[[^\]]+\]\[chart\]$", text, re.M) and f"[chart]: {REPO_BLOB}docs/results.png" in text
    assert "help page" in text
