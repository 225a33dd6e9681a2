# Deployment image for Blackwell (B200 / GB200: sm_100a; B300: sm_103a).
#   docker build -t nvfp4-plugin .
#   docker run --gpus all nvfp4-plugin nvfp4-plugin info
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 \
    NVFP4_PLUGIN_CUDA_ARCHS="10.0a;10.3a"
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --upgrade pip && pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130

WORKDIR /opt/nvfp4-plugin
COPY . .
RUN pip install --no-build-isolation .
CMD ["nvfp4-plugin", "info"]
