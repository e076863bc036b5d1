"""Check every answer before a single file is written.

The answers reach this script as JSON data (``tojson`` escapes every quote, so the
rendered text is a plain string literal); no answer is ever pasted into this source
as code. Each ``check_<field>`` function returns ``None`` when the value is fine,
or what is allowed. A bad answer stops generation with one line per bad field on
stderr, and cookiecutter removes the project folder it had created.
"""

import json
import keyword
import re
import sys

# Single quotes on purpose: tojson output holds double quotes and never a single one.
ANSWERS = json.loads(r'{{ cookiecutter | tojson }}')  # fmt: skip
# Below, the source is taken literally (no Jinja): {% raw %}

COMPATIBILITY = ANSWERS["_compatibility"]
LICENSES = ("MIT", "Apache-2.0", "BSD-3-Clause", "Proprietary")
TEMPLATE_SYNTAX = ("{{", "{%", "{#")

# Modules a project's package must not shadow: the standard library and what users
# of this template import next to it (a package named `torch` or `tests` would be
# imported instead of the real one).
SHADOWED_MODULES = frozenset(sys.stdlib_module_names) | {
    "torch", "torchvision", "torchaudio", "torchtext", "functorch", "triton",
    "numpy", "scipy", "pandas", "matplotlib", "sklearn", "PIL", "cv2", "tqdm",
    "yaml", "transformers", "datasets", "accelerate", "lightning", "tensorboard",
    "pytest", "_pytest", "pluggy", "xdist", "hypothesis", "test", "tests",
    "conftest", "setuptools", "pkg_resources", "pip", "wheel", "hatchling",
    "IPython", "jupyter", "jupyterlab", "notebook", "ipykernel", "pre_commit",
    "ruff", "src",
}  # fmt: skip

PROJECT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_.][A-Za-z0-9]+)*")
PACKAGE_NAME = re.compile(r"[a-z][a-z0-9_]*")
# A practical subset of RFC 5322 addresses: what PyPI metadata and git accept.
EMAIL = re.compile(r"[A-Za-z0-9.!#$%&'*+/=?^_`|~-]+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
                   r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+")  # fmt: skip
PORT = re.compile(r"[1-9][0-9]*")


def package_for(project):
    """The package name the template derives from a project name (see cookiecutter.json)."""
    return project.lower().replace("-", "_").replace(".", "_")


def module_name_problem(name):
    """What a package name must be instead of ``name``, or None when it is fine."""
    if keyword.iskeyword(name):
        return f"a package name ({name!r} here) that is not a Python keyword"
    if name in SHADOWED_MODULES or name.lower() in SHADOWED_MODULES:
        return (
            f"a package name ({name!r} here) that does not shadow a module users import "
            "(the standard library, torch, numpy, pytest, test, tests, ...)"
        )
    return None


def check_project(value):
    if not isinstance(value, str) or not PROJECT_NAME.fullmatch(value) or len(value) > 64:
        return (
            "at most 64 ASCII letters, digits and single '-', '_' or '.' between them, "
            "starting with a letter (e.g. dynamic-model)"
        )
    return module_name_problem(package_for(value))


def check_package(value):
    if not isinstance(value, str) or not PACKAGE_NAME.fullmatch(value) or len(value) > 64:
        return (
            "a lowercase Python identifier of at most 64 ASCII letters, digits and '_', "
            "starting with a letter (e.g. dynamic_model)"
        )
    return module_name_problem(value)


def free_text_problem(value, max_length):
    if not isinstance(value, str) or not value.strip():
        return "non-empty text"
    if len(value) > max_length:
        return f"at most {max_length} characters"
    if any(ord(char) < 32 or ord(char) == 127 for char in value):
        return "one line of text without control characters"
    if any(marker in value for marker in TEMPLATE_SYNTAX):
        return "text without template syntax ({{, {%, {#)"
    return None


def check_description(value):
    return free_text_problem(value, 200)


def check_author(value):
    return free_text_problem(value, 100)


def check_email(value):
    if not isinstance(value, str) or not EMAIL.fullmatch(value) or len(value) > 254:
        return "an email address like you@example.com (ASCII, one '@', a dotted domain)"
    return None


def check_torch_version(value):
    known = list(COMPATIBILITY["torch_cuda"])
    if value not in known:
        return f"one of {', '.join(known)}"
    return None


def listed_for_torch(table, value, allowed):
    """None if ``value`` is in the chosen torch's row of ``table``, else what is ``allowed``."""
    torch = ANSWERS.get("torch_version")
    row = COMPATIBILITY[table].get(torch)
    if row is None or value in row:
        return None  # an unknown torch version is reported under torch_version
    return f"{allowed.format(torch=torch)}: {', '.join(row)}"


def check_cuda_version(value):
    return listed_for_torch("torch_cuda", value, "a CUDA version torch {torch} is built for")


def check_python_version(value):
    problem = listed_for_torch("torch_python", value, "a Python version torch {torch} supports")
    if problem:
        return problem
    torch = ANSWERS.get("torch_version")
    image_python = COMPATIBILITY.get("image_python", {}).get(torch)
    if image_python is not None and version_key(value) > version_key(image_python):
        allowed = [
            p
            for p in COMPATIBILITY["torch_python"][torch]
            if version_key(p) <= version_key(image_python)
        ]
        return (
            f"a Python version at most {image_python}, the Python of the pytorch/pytorch:{torch} "
            f"images (the project must install into it in the dev container): {', '.join(allowed)}"
        )
    return None


def version_key(text):
    return tuple(int(part) for part in str(text).split("."))


def port_problem(value):
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not PORT.fullmatch(text) or not 1024 <= int(text) <= 65535:
        return "a port number from 1024 to 65535 (no leading zeros)"
    return None


def check_ssh_port(value):
    return port_problem(value)


def check_jupyter(value):
    if not isinstance(value, bool):
        return "yes or no"
    return None


def check_jupyter_port(value):
    problem = port_problem(value)
    if problem:
        return problem
    if ANSWERS.get("jupyter") is True and str(value) == str(ANSWERS.get("ssh_port")):
        return "a port number from 1024 to 65535 other than ssh_port (both are published)"
    return None


def check_license(value):
    if value not in LICENSES:
        return f"one of {', '.join(LICENSES)}"
    return None


CHECKS = {
    "project": check_project,
    "package": check_package,
    "description": check_description,
    "author": check_author,
    "email": check_email,
    "python_version": check_python_version,
    "torch_version": check_torch_version,
    "cuda_version": check_cuda_version,
    "ssh_port": check_ssh_port,
    "jupyter": check_jupyter,
    "jupyter_port": check_jupyter_port,
    "license": check_license,
}


def problems(answers):
    """One line per bad answer: the field, the value and what is allowed."""
    lines = []
    for field, check in CHECKS.items():
        value = answers.get(field)
        if field == "package" and lines and value == package_for(str(answers.get("project"))):
            continue  # derived from a project name already reported
        allowed = check(value)
        if allowed:
            lines.append(f"error: {field} = {value!r} is not allowed: expected {allowed}")
    return lines


if __name__ == "__main__":
    lines = problems(ANSWERS)
    if lines:
        print("\n".join(lines), file=sys.stderr)
        sys.exit(1)
# {% endraw %}
