#!/usr/bin/env bash
# Every GPU check of the template, on a machine with an NVIDIA GPU, in under 8 minutes
# on one H200: one step per script (environment, plugin, determinism, gradcheck,
# commands, compile: see each *_gpu.sh), each under a time limit; the limits add up to 470 s.
#
#   bash benchmarks/gpu_checks/all.sh [--dry-run] [STEP...]
#
# Needs Python with a CUDA build of torch ($PYTHON, default python3), and pytest for
# the pytest checks; nothing is installed (GPU machines here have no network): a check
# whose module is missing (pytest, pytest-xdist) is skipped and says which. Without
# cookiecutter the project is copied instead of baked (bake.sh).
# STEP...: only those steps, e.g. to rerun the ones that failed.
# --dry-run: the same steps on a machine without CUDA; the checks that need CUDA are
# skipped ("skipped (dry run: needs CUDA)"), the others run, many on the CPU, under
# time limits three times as long. It catches script errors: a wrong path, flag or
# module. The template's tests run it.
#
# Writes <step>.log (every check's command and output) and summary.md (check | result |
# seconds) under $OUT when it is set, else under a new temporary folder; prints the
# summary. Exit status 1 when a check or a step failed, 2 for a bad argument.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# step:seconds, in the order they run.
all_steps=(environment:20 plugin:100 determinism:80 gradcheck:40 commands:160 compile:70)

usage() {
    sed -n '2,/^set /{/^set /d;s/^# \{0,1\}//;p}' "$0"
}

dry_run=0
selected=()
for argument; do
    case "$argument" in
        --dry-run) dry_run=1 ;;
        -h | --help) usage; exit 0 ;;
        *)
            known=0
            for entry in "${all_steps[@]}"; do
                if [ "${entry%%:*}" = "$argument" ]; then known=1; fi
            done
            if [ "$known" = 0 ]; then
                names=$(printf '%s ' "${all_steps[@]%%:*}")
                echo "all.sh: unknown step or option '$argument'; steps: ${names% }; option: --dry-run" >&2
                exit 2
            fi
            selected+=("$argument")
            ;;
    esac
done

out=${OUT:-}
if [ -z "$out" ]; then out=$(mktemp -d); fi
mkdir -p "$out" || exit 1
results="$out/results.tsv"
: >"$results"
scale=1
if [ "$dry_run" = 1 ]; then scale=3; fi
export GPU_CHECKS_RESULTS="$results" GPU_CHECKS_DRY_RUN="$dry_run" GPU_CHECKS_TIMEOUT_SCALE="$scale"

now_us() {
    if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/[.,]/}"; else date +%s%6N; fi
}
seconds_since() {
    local elapsed=$(($(now_us) - $1))
    echo "$((elapsed / 1000000)).$((elapsed % 1000000 / 100000))"
}

started=$(now_us)
failed_steps=0
ran_environment=0
for entry in "${all_steps[@]}"; do
    step=${entry%%:*} limit=$((${entry#*:} * scale))
    if [ ${#selected[@]} -gt 0 ] && [[ " ${selected[*]} " != *" $step "* ]]; then continue; fi
    if [ "$step" = environment ]; then ran_environment=1; fi
    echo "##### $step (at most $limit s): $out/$step.log"
    step_start=$(now_us)
    GPU_CHECKS_STEP=$step timeout -k 10 "$limit" bash "$here/${step}_gpu.sh" >"$out/$step.log" 2>&1
    status=$?
    grep -E '^=== (PASS|FAIL|SKIP) ' "$out/$step.log"
    case "$status" in
        0) result=passed ;;
        124 | 137) result="failed (the step ran past its $limit s)" ;;
        *) result="failed (exit status $status; see $step.log)" ;;
    esac
    if [ "$status" -ne 0 ]; then failed_steps=$((failed_steps + 1)); fi
    printf '%s\t%s\t%s\t%s\n' "$step" "(whole step)" "$result" "$(seconds_since "$step_start")" \
        >>"$results"
done
total=$(seconds_since "$started")

{
    mode="on ${HOSTNAME:-this machine}"
    if [ "$dry_run" = 1 ]; then mode="$mode, dry run (no CUDA)"; fi
    echo "# GPU checks, $(date -u '+%Y-%m-%d %H:%M UTC'), $mode"
    echo
    if [ "$ran_environment" = 1 ]; then  # what it found
        awk '(/^torch [0-9]/ && !torch++) || /^cuda:[0-9]+: / { print $0 "  " }' "$out/environment.log"
        echo
    fi
    echo "| check | result | seconds |"
    echo "| --- | --- | --- |"
    while IFS=$'\t' read -r step name result seconds; do
        if [ "$name" = "(whole step)" ]; then
            echo "| **$step** (whole step) | **${result//|/\\|}** | $seconds |"
        else
            echo "| $step: ${name//|/\\|} | ${result//|/\\|} | $seconds |"
        fi
    done <"$results"
    echo
    checks=$(awk -F'\t' '$2 != "(whole step)"' "$results")
    passed=$(grep -c $'\tpassed\t' <<<"$checks")
    failed=$(grep -c $'\tfailed' <<<"$checks")
    skipped=$(grep -c $'\tskipped' <<<"$checks")
    echo "$passed passed, $failed failed, $skipped skipped; $failed_steps step(s) failed; $total s in all."
} >"$out/summary.md"
echo
cat "$out/summary.md"
if [ "$failed_steps" -ne 0 ]; then exit 1; fi
