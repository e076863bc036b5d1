"""What the dev-container tests share."""

# The Dev Containers CLI the template's own dev container installs and the end-to-end
# test (test_devcontainer_e2e) runs; one version, so both see the same CLI.
DEVCONTAINER_CLI_VERSION = "0.89.0"
