# Sourced by the device scripts, in the repository's root: the wheels of .whl/ (tools/device_wheels.sh) live in one
# folder on the lent machine (it has no network), on PYTHONPATH with the repository. With `install`, put them there.
site=/tmp/site
if [ "${1:-}" = install ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    || exit 1
fi
# The project is not installed there: tools/evident/ links its folders under the `evident` namespace.
export PYTHONPATH=$site:$PWD/tools:$PWD PYTHONUNBUFFERED=1
