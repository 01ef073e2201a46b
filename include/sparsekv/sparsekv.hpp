#pragma once
// sparsekv: sparse-attention decoding over a CPU-resident KV cache with a GPU
// working set. This header is the engine-facing facade (docs/integration.md);
// the layers below it live in their own folders (docs/design.md).
#include "sparsekv/core/config.hpp"
#include "sparsekv/core/error.hpp"
#include "sparsekv/core/error_slot.hpp"
#include "sparsekv/core/model_shape.hpp"
#include "sparsekv/attention/attend_plan.hpp"
#include "sparsekv/facade/in_place_backend.hpp"
#include "sparsekv/facade/manager.hpp"
#include "sparsekv/facade/serving_config.hpp"
#include "sparsekv/policy/any_policy.hpp"
#include "sparsekv/policy/policy_registry.hpp"
#include "sparsekv/policy/dense.hpp"
#include "sparsekv/policy/h2o.hpp"
#include "sparsekv/policy/quest.hpp"
#include "sparsekv/policy/retroinfer.hpp"
#include "sparsekv/policy/shadowkv.hpp"
#include "sparsekv/policy/streaming_eviction.hpp"
#include "sparsekv/policy/streaming_window.hpp"
