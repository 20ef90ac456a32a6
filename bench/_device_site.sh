# Sourced by the device scripts: install the wheels in .whl/ (the Python packages the GPU
# machine lacks; see the device notes) into a fresh folder and put it and the checkout on
# PYTHONPATH. Sets $work, a scratch folder for the caller.
work=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$work/site" .whl/*.whl
    export PYTHONPATH="$work/site:$PWD"
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
