"""A task's image, built on the host: its Dockerfile's layer and what its scripts install.

    host_tools.py    what the host offers in place of an image's packages; apt/pip/uv/uvx stand-ins
    shell_syntax.py  the simple commands of a shell script, read with tree-sitter-bash
    installs.py      a script's install steps: what the host has, what to fetch, what cannot be had
    packages.py      what the host lacks, fetched from the registries into a task's layer; base images
    pypi.py          PyPI's packages for the sandbox's interpreter (packages.python_packages)
    debian.py        Debian's packages, unpacked with a private apt (packages.debian_packages)
    fetched.py       what a fetch did (Report) and the machine's cache of fetched packages
    dockerfile.py    a task's Dockerfile, read by Docker's own grammar (the ``dockerfile`` package)
    context.py       where a task's image is built from: its Dockerfile and build context
    build.py         the image built once into a cached layer: RUN in the build sandbox, COPY anywhere
"""
