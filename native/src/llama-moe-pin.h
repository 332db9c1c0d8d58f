// llama-moe-pin.h (internal): page-locked expert weights for models loaded with mmap (pyllama_moe).
//
// Expert tensors kept on the host (--cpu-moe, -ncmoe, --fit) are mmap'ed from the model file by default,
// i.e. pageable: a GPU uploads them through a bounce buffer, several times slower than from page-locked
// memory and without overlapping compute. At load, when a GPU's registry offers ggml_backend_host_map
// (ggml-host-map.h), the model page-locks the mapped ranges of its experts, each range on its own and never
// across two file mappings (the shards of a split model); the experts of ranges that fail are copied once
// into the GPU's pinned host buffer type, if they fit in the memory actually available, and the ranges that
// registered stay registered; else they stay pageable. Registration takes only what fits the memory available less a margin, or the budget of
// llama_moe_default_set_pin_budget_mib (--pin-budget, LLAMA_MOE_PIN_BUDGET_MIB) if lower: page-locked pages
// cannot be reclaimed, and experts larger than memory are a main reason to keep them on the host. Which path
// was taken, how much was pinned and why not more, is logged once per model. Knob:
// llama_moe_default_set_pin_experts (llama-moe.h, --pin-experts/--no-pin-experts) > LLAMA_MOE_PIN_EXPERTS > on;
// GGML_CUDA_NO_PINNED turns it off too.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

struct llama_model;

// end of llama_model::load_tensors, after the tensor data is in place; maps: [addr, size) of each file mapping
void llama_moe_pin_experts_load(llama_model & model, const std::vector<std::pair<void *, size_t>> & maps);

// ~llama_model, before its buffers and mappings go: releases the model's reference or its pinned copy
void llama_moe_pin_experts_free(const llama_model & model);

// llama_context: each live context holds a reference to the model's page-locked ranges, so the count kept by
// the backend reflects every user of the range (acquire at the end of the constructor, release in the
// destructor after the context's queued work is done)
void llama_moe_pin_experts_ctx_acquire(const llama_model & model);
void llama_moe_pin_experts_ctx_release(const llama_model & model);
