# Serving image for NVFP4 checkpoints: vLLM's OpenAI server (SGLang's with --build-arg ENGINE=sglang and that
# engine's image as BASE_IMAGE) with this plugin, its compiled kernels built for sm_90a (H100/H200), sm_100a
# (B200/GB200) and sm_103a (B300). The build steps are docker/build.sh, which CI and the GPU machine also run
# outside Docker.
#   docker build -t nvfp4-serve .
#   docker run --gpus all -p 8000:8000 -v /models:/models -e MODEL=/models/Llama-3-8B-nvfp4 nvfp4-serve [extra args]
#   docker build -t nvfp4-serve-sglang --build-arg ENGINE=sglang --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.17 .
ARG BASE_IMAGE=vllm/vllm-openai:v0.26.0
FROM ${BASE_IMAGE}

ARG ENGINE=vllm
ENV NVFP4_PLUGIN_ENGINE=${ENGINE} \
    NVFP4_PLUGIN_CUDA_ARCHS="9.0a;10.0a;10.3a" \
    PIP_NO_CACHE_DIR=1 \
    PORT=8000

WORKDIR /opt/nvfp4-plugin
COPY . .
# the engine image brings torch, CUDA and nvcc; build the extension against them, then check it
RUN bash docker/build.sh && rm -rf build

RUN useradd --create-home --uid 10001 serve
USER 10001
ENV HOME=/home/serve
WORKDIR /home/serve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "/opt/nvfp4-plugin/docker/healthcheck.py"]
ENTRYPOINT ["/opt/nvfp4-plugin/docker/entrypoint.sh"]
