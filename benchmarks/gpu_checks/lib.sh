# shellcheck shell=bash
# Sourced by each GPU check script (`source lib.sh "$@"`): its options, a scratch
# folder, the baked project, and `check`, which runs one check, shows its output and
# records its result. The script's working directory becomes the template's root.
#
#   --dry-run, or GPU_CHECKS_DRY_RUN=1: on a machine without CUDA. Checks marked
#       --cuda are recorded as skipped; `$device` is cpu instead of cuda, so the checks
#       that take a device run on the CPU.
#   PYTHON: the interpreter with torch (default: python3).
#   GPU_CHECKS_RESULTS: a file each check appends a row to (step, check, result,
#       seconds; tab-separated); all.sh makes its summary from it.
#   GPU_CHECKS_STEP: the step named in those rows (default: the script's name less
#       _gpu.sh).
#   GPU_CHECKS_CHECK_TIMEOUT: seconds a check may run unless it says (default: 120).
#   GPU_CHECKS_TIMEOUT_SCALE: every check's time limit is multiplied by it (default 1;
#       all.sh sets 3 for a dry run: a busy CPU machine is slower than the GPU one).

python=${PYTHON:-python3}
dry_run=${GPU_CHECKS_DRY_RUN:-0}
for _option; do
    case "$_option" in
        --dry-run) dry_run=1 ;;
        *)
            echo "$(basename "$0"): unknown argument '$_option'; the only option is --dry-run" >&2
            exit 2
            ;;
    esac
done
# shellcheck disable=SC2034  # used by the scripts that source this file
device=$([ "$dry_run" = 1 ] && echo cpu || echo cuda)
step=${GPU_CHECKS_STEP:-$(basename "$0" _gpu.sh)}
gpu_checks_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$gpu_checks_dir/../.." || exit 1
# shellcheck source=benchmarks/gpu_checks/bake.sh
source "$gpu_checks_dir/bake.sh"

# How pytest loads the project's plugin. A project baked with cookiecutter loads it from
# its own pytest configuration as well; a copied one has none. Loading it twice is harmless.
PLUGIN_ARGS=(-p dynamic_model.testing.plugin)
# shellcheck disable=SC2034  # used by the scripts that source this file
pytest_command=("$python" -m pytest "${PLUGIN_ARGS[@]}" -p no:cacheprovider -p no:randomly)
# "${stdout_to[@]}" FILE COMMAND...: runs COMMAND with its standard output in FILE.
# shellcheck disable=SC2016,SC2034  # expanded by sh; used by the scripts that source this file
stdout_to=(sh -c 'exec "$@" >"$0"')

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
checks_run=0
checks_failed=0
project=

_now_us() {
    if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/[.,]/}"; else date +%s%6N; fi
}

_seconds_since() {  # _seconds_since START_US: elapsed seconds, one decimal
    local elapsed=$(($(_now_us) - $1))
    echo "$((elapsed / 1000000)).$((elapsed % 1000000 / 100000))"
}

_record() {  # _record NAME RESULT SECONDS
    case "$2" in
        passed) echo "=== PASS $1 ($3 s)" ;;
        skipped*) echo "=== SKIP $1: $2" ;;
        *) echo "=== FAIL $1: $2"; checks_failed=$((checks_failed + 1)) ;;
    esac
    if [ -n "${GPU_CHECKS_RESULTS:-}" ]; then
        printf '%s\t%s\t%s\t%s\n' "$step" "$1" "$2" "$3" >>"$GPU_CHECKS_RESULTS"
    fi
}

# check NAME [--status N] [--expect ERE]... [--cuda] [--needs MODULE]... [--timeout S] -- COMMAND...
# Runs COMMAND, shows its output (stdout and stderr) and passes when it exits with
# status N (default 0) and every ERE (grep -E) occurs in the output. --cuda: skipped
# in a dry run. --needs: skipped when $python cannot import MODULE. The output stays
# in the file $check_output until the next check.
check() {
    local name=$1 expected=0 timeout_s=${GPU_CHECKS_CHECK_TIMEOUT:-120} cuda=0
    local patterns=() modules=() problems=() module pattern start status
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        case "$1" in
            --status) expected=$2; shift 2 ;;
            --expect) patterns+=("$2"); shift 2 ;;
            --timeout) timeout_s=$2; shift 2 ;;
            --needs) modules+=("$2"); shift 2 ;;
            --cuda) cuda=1; shift ;;
            *) _record "$name" "failed (the script passes check an unknown option: $1)" 0.0; return ;;
        esac
    done
    if [ $# -lt 2 ]; then
        _record "$name" "failed (the script passes check no '-- COMMAND')" 0.0
        return
    fi
    shift
    echo "=== $name: $*"
    if [ "$cuda" = 1 ] && [ "$dry_run" = 1 ]; then
        _record "$name" "skipped (dry run: needs CUDA)" 0.0
        return
    fi
    for module in "${modules[@]}"; do
        if ! "$python" -c "import $module" 2>/dev/null; then
            _record "$name" "skipped ($python cannot import $module)" 0.0
            return
        fi
    done
    timeout_s=$((timeout_s * ${GPU_CHECKS_TIMEOUT_SCALE:-1}))
    checks_run=$((checks_run + 1))
    check_output="$work/check-$checks_run.out"
    start=$(_now_us)
    timeout -k 10 "$timeout_s" "$@" >"$check_output" 2>&1
    status=$?
    cat "$check_output"
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        problems+=("timed out after $timeout_s s")
    elif [ "$status" -ne "$expected" ]; then
        problems+=("exit status $status, expected $expected")
    fi
    for pattern in "${patterns[@]}"; do
        grep -qE -- "$pattern" "$check_output" || problems+=("missing: $pattern")
    done
    if [ ${#problems[@]} -eq 0 ]; then
        _record "$name" passed "$(_seconds_since "$start")"
    else
        local joined
        joined=$(printf '; %s' "${problems[@]}")
        _record "$name" "failed (${joined#; })" "$(_seconds_since "$start")"
    fi
}

# collect_tests PATH...: the check that pytest collects PATH... without --gpu (GPU
# tests are skipped then, so it runs in a dry run too): a module the tests import that
# moved, or a fixture module that fails to load, fails it.
collect_tests() {
    local path expects=()
    for path; do expects+=(--expect "^${path//./\\.}"); done
    check "collect the tests without --gpu" --needs pytest "${expects[@]}" -- \
        "${pytest_command[@]}" --collect-only -q "$@"
}

# bake TEST...: the default project in $project (see bake.sh), its src on PYTHONPATH,
# recorded as the check "bake"; the script ends if baking fails.
bake() {
    local start
    start=$(_now_us)
    echo "=== bake"
    if ! project=$(bake_project "$work" "$@"); then
        _record bake "failed (see the output above)" "$(_seconds_since "$start")"
        finish_checks
    fi
    _record bake passed "$(_seconds_since "$start")"
    export PYTHONPATH="$project/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}

# finish_checks: the script's last line; exits 1 if a check failed.
finish_checks() {
    if [ "$checks_failed" -ne 0 ]; then
        echo "$step: $checks_failed check(s) FAILED"
        exit 1
    fi
    echo "$step: every check passed or was skipped"
    exit 0
}
