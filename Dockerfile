# The project's image: `mhc` (fit / validate / sweep / compare) and optuna-dashboard, same pinned versions
# as a local install. CPU torch by default; docker/compose.gpu.yml passes a CUDA wheel index instead.
# The image has no .git: build it with `--build-arg GIT_COMMIT=$(git rev-parse HEAD)` so that every run records the
# commit it was built from (tag mhc.build.commit); runs are told apart by the digest of their sources either way.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MHC_CACHE_DIR=/cache \
    MPLBACKEND=Agg
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch first, from the chosen index, so that installing the package never swaps in another build
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4,<=2.14.1"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY mhc_lightning ./mhc_lightning
COPY kernels ./kernels
# the package carries a copy of conf/ (its defaults); /app/conf, read first from /app, stays editable data
COPY conf ./conf
RUN pip install ".[postgres,dashboard]"
ARG GIT_COMMIT=unknown
RUN echo "${GIT_COMMIT}" > /app/BUILD_COMMIT
ENV MHC_BUILD_COMMIT_FILE=/app/BUILD_COMMIT
# sweep files stay editable data, outside site-packages
COPY sweeps ./sweeps

ENTRYPOINT ["mhc"]
CMD ["--help"]
