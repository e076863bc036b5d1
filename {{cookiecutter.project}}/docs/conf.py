"""Sphinx settings of the documentation site: the Markdown pages of docs/, as written.

Build it strictly, as CI does (every warning fails the build: a link to a missing page
or to a missing heading, a page in no toctree):

    python -m pip install --editable ".[docs]"  # where torch is installed (the dev container)
    python -m sphinx -W --keep-going -n -b html docs docs/_build/html

The site is docs/ alone. A link out of docs/ (to ../README.md, to ../src/...) is a
link Sphinx cannot resolve, so it fails the build: README.md links into docs/, never
the reverse, and docs/index.md is the site's first page. A new page goes into the
hidden toctree at the end of docs/index.md, which orders the site's pages (its fence
has four backticks, so tests/test_docs.py, which reads ``` fences, passes over it).
Nothing here imports the package, so the build needs neither it nor torch.
"""

project = "{{ cookiecutter.project }}"

extensions = ["myst_parser"]
html_theme = "pydata_sphinx_theme"

# Headings down to ### get the anchors GitHub gives them, so `page.md#a-heading`
# works both on the code host and in the site (and a missing one is a warning).
myst_heading_anchors = 3

exclude_patterns = ["_build"]
