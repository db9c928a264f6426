# hettp for GPU clusters: NGC's PyTorch image (CUDA torch, apex, Transformer Engine) plus
# megatron-core 0.16.1 and this project. The image's own torch is kept.
#   docker build -t hettp .
#   docker run --gpus all --ipc=host --rm hettp \
#     torchrun --nproc_per_node 8 pretrain_gpt.py --tensor-model-parallel-size 8 ... --bf16
FROM nvcr.io/nvidia/pytorch:25.04-py3

WORKDIR /workspace/hettp
COPY requirements-gpu.txt ./
RUN pip install --no-cache-dir -r requirements-gpu.txt
COPY . .
RUN pip install --no-cache-dir --no-deps -e . --config-settings editable_mode=compat \
    && python -c "import megatron.core, megatron.hetero, hettp; print('hettp ready')"

ENV CUDA_DEVICE_MAX_CONNECTIONS=1
CMD ["python", "pretrain_gpt.py", "--help"]
