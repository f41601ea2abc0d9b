"""A task's image, built on the host: its Dockerfile's layer and what its scripts install.

    host_tools.py    what the host offers in place of an image's packages; apt/pip/uv/uvx stand-ins
    shell_syntax.py  the simple commands of a shell script, read with tree-sitter-bash
    installs.py      a script's install steps, resolved against the host
    dockerfile.py    a task's Dockerfile, read by Docker's own grammar (the ``dockerfile`` package)
    context.py       where a task's image is built from: its Dockerfile and build context
    build.py         the image built once into a cached layer: RUN in the build sandbox, COPY anywhere
"""
