"""Check every answer before a single file is written.

Each ``check_<field>(value, answers)`` returns ``None`` when the value is fine, or
what is allowed; ``problems(answers)`` turns those into one line per bad field,
naming the field, the value and what is allowed. The same functions run twice:
``local_extensions.py`` calls them while cookiecutter resolves the answers, before
it creates the project folder (so no refused ``project`` leaves a folder anywhere),
and cookiecutter runs this file as its pre-generation hook, which receives the
answers as JSON data (see the last lines); no answer is ever pasted into this
source as code. Below, the source is taken literally (no Jinja): {% raw %}
"""

import json
import keyword
import re
import sys
import unicodedata

LICENSES = ("MIT", "Apache-2.0", "BSD-3-Clause", "Proprietary")
TEMPLATE_SYNTAX = ("{{", "{%", "{#")
# Unicode categories free text must not hold: controls, format characters (bidi
# overrides, zero-width spaces, byte order marks), line and paragraph separators,
# and surrogates (half characters, not encodable as UTF-8).
REFUSED_CATEGORIES = {
    "Cc": "control",
    "Cf": "format",
    "Zl": "line separator",
    "Zp": "paragraph separator",
    "Cs": "surrogate",
}
# Zero-width (non-)joiners are format characters that scripts and emoji need inside a
# word (Persian, Indic scripts, family and profession emoji); they are allowed there.
JOINERS = ("\u200c", "\u200d")

# Modules a project's package must not shadow: the standard library and what users
# of this template import next to it (a package named `torch` or `tests` would be
# imported instead of the real one). The modules of every distribution the project
# installs (torch, its dependencies, the extras) are in cookiecutter.json's
# `_reserved_names`, with those distributions' names.
SHADOWED_MODULES = frozenset(sys.stdlib_module_names) | {
    "torchvision", "torchaudio", "torchtext", "scipy", "pandas", "sklearn", "cv2",
    "tqdm", "transformers", "datasets", "accelerate", "lightning", "hypothesis",
    "test", "tests", "conftest", "pkg_resources", "pip", "wheel", "hatchling",
    "jupyterlab", "notebook", "src",
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


def normalized(name):
    """A distribution name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def module_name_problem(name, answers):
    """What a package name must be instead of ``name``, or None when it is fine."""
    if keyword.iskeyword(name):
        return f"a package name ({name!r} here) that is not a Python keyword"
    installed = {module.lower() for module in answers["_reserved_names"]["modules"]}
    if name in SHADOWED_MODULES or name.lower() in SHADOWED_MODULES | installed:
        return (
            f"a package name ({name!r} here) that does not shadow a module users import or the "
            "project installs (the standard library, torch and the libraries it needs, those of "
            "the extras such as numpy and pytest, test, tests, ...)"
        )
    return None


def distribution_name_problem(name, answers):
    """What a project name must be instead of ``name`` when pip would take the project for
    a distribution that it installs, or None."""
    reserved = answers["_reserved_names"]
    wanted = normalized(name)
    if wanted in reserved["torch"] or wanted.startswith(tuple(reserved["torch_prefixes"])):
        clash = (
            "one torch needs: pip would take the project for it and download other "
            "torch versions, several GB each, looking for one that fits"
        )
    elif wanted in reserved["extras"]:
        clash = (
            "one the dev, train or notebook extra installs: pip would take the "
            "project for it and fail, or download older versions of what needs it"
        )
    else:
        return None
    return (
        "a project name other than those of the distributions the project installs "
        f"({wanted!r}, as pip reads the name, is {clash})"
    )


def check_project(value, answers):
    if not isinstance(value, str) or not PROJECT_NAME.fullmatch(value) or len(value) > 64:
        return (
            "at most 64 ASCII letters, digits and single '-', '_' or '.' between them, "
            "starting with a letter (e.g. dynamic-model)"
        )
    return distribution_name_problem(value, answers) or module_name_problem(
        package_for(value), answers
    )


def check_package(value, answers):
    if not isinstance(value, str) or not PACKAGE_NAME.fullmatch(value) or len(value) > 64:
        return (
            "a lowercase Python identifier of at most 64 ASCII letters, digits and '_', "
            "starting with a letter (e.g. dynamic_model)"
        )
    return module_name_problem(value, answers)


def is_visible(char):
    """Letters, marks' bases, digits, punctuation and symbols: what a reader can see."""
    return unicodedata.category(char)[0] in "LNPS"


def refused_character(text):
    """``(index, category name)`` of the first character free text must not hold, or None."""
    for index, char in enumerate(text):
        category = unicodedata.category(char)
        if category not in REFUSED_CATEGORIES:
            continue
        if char in JOINERS and 0 < index < len(text) - 1:
            before, after = unicodedata.category(text[index - 1]), text[index + 1]
            if before[0] in "LNPSM" and is_visible(after):
                continue
        return index, REFUSED_CATEGORIES[category]
    return None


def character_name(char):
    """``U+202E RIGHT-TO-LEFT OVERRIDE``; surrogates and some controls have no name."""
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" {name}" if name else "")


def free_text_problem(value, max_length):
    if not isinstance(value, str) or not any(is_visible(char) for char in value):
        return "text with at least one visible character"
    if len(value) > max_length:
        return f"at most {max_length} characters"
    refused = refused_character(value)
    if refused:
        index, kind = refused
        return (
            "one line of text without control, format, line or paragraph separator or "
            f"surrogate characters (found {kind} character {character_name(value[index])} "
            f"at position {index + 1})"
        )
    if any(marker in value for marker in TEMPLATE_SYNTAX):
        return "text without template syntax ({{, {%, {#)"
    return None


def check_description(value, answers):
    return free_text_problem(value, 200)


def check_author(value, answers):
    return free_text_problem(value, 100)


def check_email(value, answers):
    if not isinstance(value, str) or not EMAIL.fullmatch(value) or len(value) > 254:
        return "an email address like you@example.com (ASCII, one '@', a dotted domain)"
    return None


def check_torch_version(value, answers):
    known = list(answers["_compatibility"]["torch_cuda"])
    if value not in known:
        return f"one of {', '.join(known)}"
    return None


def listed_for_torch(table, value, answers, allowed):
    """None if ``value`` is in the chosen torch's row of ``table``, else what is ``allowed``."""
    torch = answers.get("torch_version")
    row = answers["_compatibility"][table].get(torch)
    if row is None or value in row:
        return None  # an unknown torch version is reported under torch_version
    return f"{allowed.format(torch=torch)}: {', '.join(row)}"


def check_cuda_version(value, answers):
    return listed_for_torch(
        "torch_cuda", value, answers, "a CUDA version torch {torch} is built for"
    )


def check_python_version(value, answers):
    problem = listed_for_torch(
        "torch_python", value, answers, "a Python version torch {torch} supports"
    )
    if problem:
        return problem
    torch = answers.get("torch_version")
    compatibility = answers["_compatibility"]
    image_python = compatibility.get("image_python", {}).get(torch)
    if image_python is not None and version_key(value) > version_key(image_python):
        allowed = [
            p
            for p in compatibility["torch_python"][torch]
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


def check_ssh_port(value, answers):
    return port_problem(value)


def check_jupyter(value, answers):
    if not isinstance(value, bool):
        return "yes or no"
    return None


def check_jupyter_port(value, answers):
    problem = port_problem(value)
    if problem:
        return problem
    if answers.get("jupyter") is True and str(value) == str(answers.get("ssh_port")):
        return "a port number from 1024 to 65535 other than ssh_port (both are published)"
    return None


def check_license(value, answers):
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
    """One line per bad answer: the field, the value and what is allowed.

    ``answers`` is cookiecutter's context: the answers, the ``_compatibility`` table and the
    ``_reserved_names``.
    """
    lines = []
    for field, check in CHECKS.items():
        value = answers.get(field)
        if field == "package" and lines and value == package_for(str(answers.get("project"))):
            continue  # derived from a project name already reported
        allowed = check(value, answers)
        if allowed:
            lines.append(f"error: {field} = {value!r} is not allowed: expected {allowed}")
    return lines


# {% endraw %}
if __name__ == "__main__":
    # Single quotes on purpose: tojson output holds double quotes and never a single one.
    lines = problems(json.loads(r'{{ cookiecutter | tojson }}'))  # fmt: skip
    if lines:
        print("\n".join(lines), file=sys.stderr)
        sys.exit(1)
