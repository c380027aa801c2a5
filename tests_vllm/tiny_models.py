"""Tiny model configs of the vLLM suite beside conftest.py's (Llama, DeepSeek-V3): a Qwen2-style standard-attention
model, GQA (4 query heads on 2 KV heads, head dim 64) with qkv bias (Qwen2 projections always carry one), the
o_proj NVFP4 through the test quant method. Also read by bench/vllm_op_overhead.py."""

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "quantization_config": {"quant_method": "fusion_pass_test_nvfp4"},
}
