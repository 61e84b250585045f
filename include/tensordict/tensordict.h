#pragma once
// Umbrella include for the core library (no transport).

#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"
#include "tensordict/errors.h"
#include "tensordict/lazy_stack.h"
#include "tensordict/log.h"
#include "tensordict/memmap.h"
#include "tensordict/module.h"
#include "tensordict/nested_key.h"
#include "tensordict/sub_tensor_dict.h"
#include "tensordict/tensor_dict.h"
#include "tensordict/tensorclass.h"
#include "tensordict/transfer_stats.h"
