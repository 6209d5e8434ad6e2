// cli/kernels_cmd.cc — `lockstep kernels`: every op variant, one line each.
#include <iostream>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "kernels/registry.h"

namespace lockstep::cli {

void RegisterKernels(CLI::App& app, SetAction set_action) {
  auto json = std::make_shared<bool>(false);
  auto faults = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("kernels", "List kernel variants (choose one with --kernel op=variant)");
  cmd->add_flag("--json", *json, "Machine-readable output");
  cmd->add_flag("--faults", *faults, "List the fault zoo instead (deliberately wrong variants, for --fault)");
  cmd->callback([json, faults, set_action] {
    set_action([json, faults] {
      const auto& vs = kernels::Registry::Get().variants();
      if (*json) {
        nlohmann::json j = nlohmann::json::array();
        for (const auto& v : vs) {
          if (v.fault != *faults) continue;
          j.push_back({{"op", v.op}, {"variant", v.name}, {"backend", v.backend}, {"default", v.is_default},
                       {"deterministic", v.deterministic}, {"batch_invariant", v.batch_invariant},
                       {"summary", v.summary}});
        }
        std::cout << j.dump(2) << "\n";
        return Status::Ok();
      }
      for (const auto& v : vs) {
        if (v.fault != *faults) continue;
        std::printf("%-13s %-10s %-5s %s%s\n", v.op.c_str(), v.name.c_str(), v.backend.c_str(),
                    v.is_default ? "[default] " : "", v.summary.c_str());
      }
      return Status::Ok();
    });
  });
}

}  // namespace lockstep::cli
