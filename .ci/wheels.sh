#!/usr/bin/env bash
# nam installed as a user installs it: wheels of nam-train and of every plugin in plugins/ (.ci/plugins.py reads
# the folder), installed without -e into a fresh venv, and nam's commands run from there. A package missing from
# a wheel fails here; the editable installs of the test suite cannot see it.
#
# Third-party packages (torch, megatron-core, ...) come from the calling environment: a .pth in the fresh venv
# names its site-packages folders, so nothing is downloaded or compiled but nam's own wheels. The wheels are
# built from a copy of the checkout's files (git ls-files), so a stale build/ folder cannot put a deleted module
# back into them.
#
#   bash .ci/wheels.sh        # from an environment that has nam's dependencies and setuptools (the CI venv)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/src"
mapfile -t plugins < <(python .ci/plugins.py | tr ' ' '\n')
(cd "$work/src" && python -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" . "${plugins[@]}")
built=$(ls "$work"/wheels/*.whl | wc -l)
if [[ $built -ne $((1 + ${#plugins[@]})) ]]; then
  echo "wheels: expected nam-train and ${#plugins[@]} plugins (${plugins[*]}), built $built:" >&2
  ls "$work/wheels" >&2
  exit 1
fi

python -m venv "$work/venv"
venv_python=$work/venv/bin/python
site=$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("site-packages")))' > "$site/nam-ci-deps.pth"
"$venv_python" -m pip install -q --no-deps --no-index "$work"/wheels/*.whl

# Every nam module must come from the wheels, none from the checkout or an editable install.
modules="nam_cli nam_core nam_core.data nam_core.engine nam_core.engine.megatron nam56r nam56r.blocks"
modules+=" nam56r.megatron nam56r.reference"
for folder in "${plugins[@]}"; do
  name=${folder#plugins/nam-plugin-}
  modules+=" nam_plugin_${name//-/_}.plugin"
done
(cd "$work" && "$venv_python" - $modules <<'EOF'
import importlib, pathlib, sys

prefix = pathlib.Path(sys.prefix).resolve()
problems = []
for module in sys.argv[1:]:
    try:
        path = pathlib.Path(importlib.import_module(module).__file__).resolve()
    except ImportError as e:
        problems.append(f"  {module}: missing from the wheels ({type(e).__name__}: {e}); list its package in the "
                        "distribution's pyproject.toml")
        continue
    if prefix not in path.parents:
        problems.append(f"  {module}: loads from {path}, outside the wheel venv {prefix}")
if problems:
    sys.exit("wheels: nam's modules as installed from the wheels:\n" + "\n".join(problems))
EOF
)

run() {  # run a nam command from the wheel venv, outside the checkout; its output only when it fails
  if ! (cd "$work" && env -u NAM_PLUGINS "$work/venv/bin/nam" "$@" > "$work/out.txt" 2>&1); then
    echo "wheels: \`nam $*\` failed from the wheel install:" >&2
    tail -n 40 "$work/out.txt" >&2
    exit 1
  fi
  echo "wheels: nam $*: ok"
}
run plugins list
run patches
run train --dry-run
run train --recipe nam56r --dry-run --device-profile h200 --engine megatron --nproc 8 --ep 8
echo "wheels: nam-train and ${#plugins[@]} plugin wheels installed and run in $((SECONDS - started)) s"
