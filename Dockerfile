# actorllm's image: one binary that serves on a CUDA GPU when the container is given one
# (CUDA, cuBLAS, NVRTC and NCCL are loaded at run time) and on the CPU otherwise.
#
#   scripts/build-image.sh                      # builds actorllm:latest
#   docker run --gpus all -p 8000:8000 -v /models:/models actorllm:latest \
#     --model /models/Llama-3.1-8B-Instruct --max-model-len 8192
#
# The entry point is `actorllm serve`: every argument is a serve flag, vLLM's names.

# The base images, overridable with --build-arg (the CUDA image's major.minor must match
# the cuda-cudart-dev package below).
ARG RUST_IMAGE=docker.io/library/rust:1.95-bookworm
ARG CUDA_IMAGE=docker.io/nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG CUDA_PACKAGE_VERSION=13-0

# --- build: the release binary -----------------------------------------------------------
FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY static static
COPY examples examples
RUN cargo build --release --locked --bin actorllm \
 && strip target/release/actorllm

# --- runtime: the CUDA libraries and the headers NVRTC compiles the kernels against ------
# (NCCL, for tensor parallelism, is opened as libnccl.so: the image's libnccl.so.2 is
# linked under that name.)
FROM ${CUDA_IMAGE}
ARG CUDA_PACKAGE_VERSION
RUN apt-get update \
 && apt-get install -y --no-install-recommends cuda-cudart-dev-${CUDA_PACKAGE_VERSION} curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && nccl=$(ldconfig -p | awk '/libnccl\.so\.2 /{print $NF; exit}') \
 && if [ -n "$nccl" ]; then ln -sf "$nccl" /usr/local/lib/libnccl.so && ldconfig; fi \
 && useradd --create-home --uid 10001 actorllm \
 && mkdir -p /models && chown actorllm /models
COPY --from=build /src/target/release/actorllm /usr/local/bin/actorllm
USER actorllm
# Models: mount a directory at /models, or a Hugging Face cache (HF_HOME) that holds the
# model id given to --model. Compiled kernels are cached under XDG_CACHE_HOME.
ENV HF_HOME=/models/.hf \
    XDG_CACHE_HOME=/home/actorllm/.cache \
    RUST_LOG=info
VOLUME ["/models"]
WORKDIR /home/actorllm
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["actorllm", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--model", "/models/model"]
