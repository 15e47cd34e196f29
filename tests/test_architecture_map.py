"""docs/architecture.md names every module of the three packages (a module added without its place
on the map fails here)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_on_the_map():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for package in ("masc_gadget", "sim_scanner", "training"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            parts = path.relative_to(ROOT / package).parts
            nested = len(parts) > 2 and f"`{parts[-2]}/`" in text  # a sub-package named as a folder (phantom/)
            if f"`{path.name}`" not in text and not nested:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_the_training_layers_contract_covers_every_training_module():
    import configparser

    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    layers = parser["importlinter:contract:training-layers"]["layers"]
    named = {m.strip() for line in layers.splitlines() for m in line.split("|") if m.strip()}
    modules = {f"training.{p.stem}" for p in (ROOT / "training").glob("*.py") if p.stem != "__init__"}
    modules |= {f"training.{p.name}" for p in (ROOT / "training").iterdir() if (p / "__init__.py").is_file()}
    assert modules <= named, f"not in the training-layers contract: {sorted(modules - named)}"
