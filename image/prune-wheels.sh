#!/bin/sh
# Run in the Containerfile's build stage (bind-mounted): delete the parts of the installed
# wheels that nothing in the images imports, by path, so a version that moves them fails
# loudly in tests/test_image.py (which imports the broker, operator and shipper in the image)
# rather than silently growing the image.
#   prune-wheels.sh VENV
# - pyarrow: C++ headers, Cython sources, its test suite, and the Flight and S3 libraries
#   (pyarrow.flight and pyarrow.fs.S3FileSystem: the audit store goes through s3fs);
#   pyarrow's own imports skip a missing S3 module.
# - kubernetes: the asyncio flavour of the client (kubernetes.aio); the operator uses the
#   synchronous one and kopf talks to the API server through aiohttp.
set -eu
site=$(echo "$1"/lib/python3*/site-packages)
cd "$site"
rm -rf pyarrow/include pyarrow/tests pyarrow/src pyarrow/includes \
    pyarrow/*.pyx pyarrow/*.pxd pyarrow/*.pxi \
    pyarrow/libarrow_flight.so* pyarrow/libarrow_python_flight.so* pyarrow/_flight.*.so \
    pyarrow/libarrow_s3.so* pyarrow/_s3fs.*.so \
    kubernetes/aio
find . -depth -type d -name tests -path './*/tests' -prune -exec rm -rf {} +
