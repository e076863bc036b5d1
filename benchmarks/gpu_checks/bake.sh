# Sourced by the GPU check scripts: bake_project WORK TEST... makes the default
# project (package dynamic_model) under WORK and prints its folder. No network: with
# cookiecutter installed in $python it bakes; without (GPU machines often lack it) it
# copies src/ as is (the template copies it without rendering) and renders the named
# generated test files by substituting the package name, the only Jinja they hold.
bake_project() {
    local work=$1 root project test
    shift
    root=$(pwd)
    project="$work/dynamic-model"
    if "$python" -c "import cookiecutter" 2>/dev/null; then
        "$python" -m cookiecutter --no-input --output-dir "$work" "$root" >/dev/null || return 1
    else
        mkdir -p "$project/src" "$project/tests" || return 1
        cp -r "$root/{{cookiecutter.project}}/src/{{cookiecutter.package}}" "$project/src/dynamic_model"
        for test in "$@"; do
            sed 's/{{ cookiecutter.package }}/dynamic_model/g' \
                "$root/{{cookiecutter.project}}/tests/$test" >"$project/tests/$test" || return 1
        done
    fi
    echo "$project"
}
