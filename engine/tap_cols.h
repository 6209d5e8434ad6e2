// engine/tap_cols.h — a tap's width for one model, read from the tap table's `cols` (engine/tap.h):
// the same expression docs/tap-points.md prints ("nh·(dn+dr); V4 nh·d"), evaluated on the
// config, so the table's widths are what the forward passes emit (tiny_model_test holds them to
// it) and what a reader of a stranger's trace can check every tensor against before indexing it.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/config.h"
#include "engine/tap.h"

namespace lockstep::engine {

// The values a row of tap `t` holds for model `c` run at emulated tensor-parallel degree `tp`;
// −1 when the expression names a symbol the run does not have (tp at TP 1, C on V4) or does not
// parse (a table entry no test let through).
int64_t TapCols(const TapPoint& t, const ModelConfig& c, int64_t tp = 1);

}  // namespace lockstep::engine
