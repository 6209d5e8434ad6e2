// cli/commands.h — each sub-command registers itself on the CLI11 app; its callback hands
// the runner to `set_action`, and main runs it and turns its Status into an exit code.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include "base/status.h"

namespace lockstep::cli {

using SetAction = std::function<void(std::function<Status()>)>;

void RegisterGenerate(CLI::App& app, SetAction set_action);
void RegisterModelInfo(CLI::App& app, SetAction set_action);
void RegisterKernels(CLI::App& app, SetAction set_action);
void RegisterTaps(CLI::App& app, SetAction set_action);
void RegisterRecord(CLI::App& app, SetAction set_action);
void RegisterInspect(CLI::App& app, SetAction set_action);
void RegisterExport(CLI::App& app, SetAction set_action);
void RegisterDegen(CLI::App& app, SetAction set_action);
void RegisterDiff(CLI::App& app, SetAction set_action);
void RegisterReplay(CLI::App& app, SetAction set_action);
void RegisterPack(CLI::App& app, SetAction set_action);
void RegisterImport(CLI::App& app, SetAction set_action);
void RegisterBisect(CLI::App& app, SetAction set_action);
void RegisterServe(CLI::App& app, SetAction set_action);
void RegisterVerify(CLI::App& app, SetAction set_action);

// The process exit code when the command succeeds (a command may set 3: "different").
int& ExitCode();

}  // namespace lockstep::cli
