#!/usr/bin/env bash
# FlashAttention-2's own test suite against flashop, on a GPU machine with flashop built:
#
#   bash tools/fa2_suite/run.sh PATH/TO/flash-attention/tests/test_flash_attn.py [pytest arguments]
#
# The test file is FlashAttention's (fetch it; it is not part of flashop). It imports `flash_attn`; this folder
# puts a stand-in of that package first on the path (flash_attn/ here), which calls flashop. Cases that use
# something flashop lacks are skipped with a reason starting "flashop lacks"; the summary line counts
# passed, failed and skipped, and `-rs` lists the reasons. Extra arguments go to pytest (e.g. -k, -x, -q), including
# fa2_select.py's --fa2-without dropout_p,local,alibi,softcap (drop the cases that use those options before they
# run) and --fa2-every N (a uniform sample).
set -euo pipefail
test_file=${1:?usage: run.sh PATH/TO/test_flash_attn.py [pytest arguments]}
shift
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$here:$(cd "$here/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m pytest "$test_file" -p no:cacheprovider -p fa2_select --rootdir "$(dirname "$test_file")" "$@"
