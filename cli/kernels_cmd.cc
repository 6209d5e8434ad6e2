// cli/kernels_cmd.cc — `lockstep kernels`: every op variant, one line each.
#include <iostream>

#include <nlohmann/json.hpp>

#include "base/json_text.h"
#include "cli/commands.h"
#include "cli/table.h"
#include "kernels/registry.h"

namespace lockstep::cli {

void RegisterKernels(CLI::App& app, SetAction set_action) {
  auto json = std::make_shared<bool>(false);
  auto faults = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("kernels", "List kernel variants (choose one with --kernel op=variant)");
  cmd->footer(
      "[default]: the backend's choice when --kernel names none.\n"
      "[cpu bits]: a CUDA variant whose CPU namesake computes the same bits; a GPU run under such variants\n"
      "replays on the CPU bit for bit (lockstep replay gpu.h5 --backend cpu --mode forced). The cuBLAS GEMMs\n"
      "(gemm=fp32, bf16, *_heuristic) have none: use gemm=fp32_dot, bf16_dot or fp8_dot for that.\n"
      "[only …]: the model types (config.json's model_type) the variant runs on; other models refuse it.");
  cmd->add_flag("--json", *json, "Machine-readable output");
  cmd->add_flag("--faults", *faults, "List the fault zoo instead (deliberately wrong variants, for --fault)");
  cmd->callback([json, faults, set_action] {
    set_action([json, faults] {
      const auto& vs = kernels::Registry::Get().variants();
      if (*json) {
        nlohmann::json j = nlohmann::json::array();
        for (const auto& v : vs) {
          if (v.fault != *faults) continue;
          nlohmann::json row = {{"op", v.op},
                                {"variant", v.name},
                                {"backend", v.backend},
                                {"default", v.is_default},
                                {"deterministic", v.deterministic},
                                {"batch_invariant", v.batch_invariant},
                                {"summary", v.summary}};
          // Whether a trace run under it replays on the CPU bit for bit (cuda variants).
          if (v.backend != "cpu") row["cpu_bits"] = v.cpu_bits;
          row["model_types"] = v.model_types;  // empty: every model
          j.push_back(std::move(row));
        }
        std::cout << JsonText(j, 2) << "\n";
        return Status::Ok();
      }
      Table t({"op", "variant", "backend", "summary"});
      for (const auto& v : vs) {
        if (v.fault != *faults) continue;
        // [cpu bits]: the CPU's variant of the same name gives the same bits (a GPU trace run
        // under it replays on the CPU bit for bit).
        std::string only;
        for (const std::string& m : v.model_types) only += (only.empty() ? "[only " : ", ") + m;
        if (!only.empty()) only += "] ";
        t.Add({v.op, v.name, v.backend,
               std::string(v.is_default ? "[default] " : "") + (v.backend != "cpu" && v.cpu_bits ? "[cpu bits] " : "") +
                   only + v.summary});
      }
      t.Print();
      return Status::Ok();
    });
  });
}

}  // namespace lockstep::cli
