"""The model a run trains: loading it as training holds it (model: fp32 master weights, the tokenizer) and LoRA/QLoRA
(lora: TRL's peft_config, the 4-bit base, adapters merged into standalone models). Reads only contract/."""
