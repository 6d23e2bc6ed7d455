# Sourced by the scripts here: make_venv DIR EXTRAS creates the virtual environment DIR
# when missing and installs kvspec into it with EXTRAS (e.g. "test,fuzz"). torch is
# pinned to the CPU build first, so nothing later pulls a multi-GB CUDA build.
make_venv() {
  local venv="$1" extras="$2"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q 'torch==2.13.0'
  "$venv/bin/python" -m pip install -q -e ".[$extras]"
}
