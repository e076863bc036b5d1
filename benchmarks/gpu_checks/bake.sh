# shellcheck shell=bash
# Sourced by the GPU check scripts: bake_project WORK TEST... makes the default
# project (package dynamic_model) under WORK and prints its folder. No network: with
# cookiecutter installed in $python it bakes; without (GPU machines often lack it) it
# copies src/ as is (the template copies it without rendering) and renders the named
# generated test files by substituting the package name, the only Jinja they hold.
# GPU_CHECKS_BAKE=copy copies even where cookiecutter is installed (what a GPU
# machine does); GPU_CHECKS_BAKE=cookiecutter insists on cookiecutter.
# Run from the template repository's root.
bake_project() {
    local work=$1 root project test mode=${GPU_CHECKS_BAKE:-auto}
    shift
    root=$(pwd)
    project="$work/dynamic-model"
    if [ "$mode" = auto ]; then
        mode=copy
        if "${python:?}" -c "import cookiecutter" 2>/dev/null; then mode=cookiecutter; fi
    fi
    case "$mode" in
        cookiecutter)
            "$python" -m cookiecutter --no-input --output-dir "$work" "$root" >/dev/null || return 1
            ;;
        copy)
            mkdir -p "$project/src" "$project/tests" || return 1
            cp -r "$root/{{cookiecutter.project}}/src/{{cookiecutter.package}}" \
                "$project/src/dynamic_model" || return 1
            for test in "$@"; do
                sed 's/{{ cookiecutter.package }}/dynamic_model/g' \
                    "$root/{{cookiecutter.project}}/tests/$test" >"$project/tests/$test" || return 1
            done
            ;;
        *)
            echo "GPU_CHECKS_BAKE=$mode: must be auto, copy or cookiecutter" >&2
            return 1
            ;;
    esac
    echo "$project"
}
