// cli/main.cc — the `lockstep` command: dispatches to one file per sub-command.
#include <CLI/CLI.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <new>
#include <set>

#include "base/version.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/help_format.h"

namespace lockstep::cli {
int& ExitCode() {
  static int code = 0;
  return code;
}
}  // namespace lockstep::cli

int main(int argc, char** argv) {
  using namespace lockstep;
  CLI::App app{
      "lockstep — a record-and-replay numerics debugger for LLM inference.\n"
      "Runs DeepSeek-family checkpoints (V2, V3, V3.2, V4) on the CPU in fp32 as the reference, and V2–V3.2 on CUDA."};
  app.require_subcommand(1);
  // Every option's --help line shows its default ("[64]"): sub-commands inherit this.
  app.option_defaults()->always_capture_default();
  app.formatter(std::make_shared<cli::HelpFormatter>());
  app.set_version_flag("--version", std::string(kVersion) + " (" + kGitRevision + ", " + kBuildType + ")");
  std::function<Status()> action;
  auto set_action = [&](std::function<Status()> f) { action = std::move(f); };
  cli::RegisterGenerate(app, set_action);
  cli::RegisterModelInfo(app, set_action);
  cli::RegisterKernels(app, set_action);
  cli::RegisterTaps(app, set_action);
  cli::RegisterRecord(app, set_action);
  cli::RegisterInspect(app, set_action);
  cli::RegisterExport(app, set_action);
  cli::RegisterDegen(app, set_action);
  cli::RegisterDiff(app, set_action);
  cli::RegisterReplay(app, set_action);
  cli::RegisterPack(app, set_action);
  cli::RegisterImport(app, set_action);
  cli::RegisterBisect(app, set_action);
  cli::RegisterVerify(app, set_action);
  cli::RegisterServe(app, set_action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line, like every other error of the tool.
    std::cerr << "lockstep: " << e.what() << " (see lockstep --help)\n";
    return 2;
  }
  if (!action) return 0;
  auto run = [&]() -> int {
    try {
      const int rc = cli::Report(action());
      return rc != 0 ? rc : cli::ExitCode();
    } catch (const std::bad_alloc&) {
      // A size no check caught (a trace's or a flag's): one line, not an abort (issue 31).
      std::cerr << "lockstep: out of memory (a size in the input or the options is larger than this machine holds)\n";
      return 1;
    }
  };
  // Commands that read traces run in a child process: libhdf5 1.10 can crash on some damaged
  // files (tests/fuzz/regressions/hdf5-1.10/), past any check lockstep can make before calling
  // it, and a trace from a stranger must not take the command down with a signal. The child's
  // output is the command's; a child killed by a signal becomes one line and exit status 1.
  static const std::set<std::string> kReadsTraces = {"inspect", "export", "diff", "replay", "pack", "bisect", "verify"};
  std::string command;
  for (const CLI::App* sub : app.get_subcommands()) command = sub->get_name();
  if (!kReadsTraces.count(command) || std::getenv("LOCKSTEP_NO_CONTAIN") != nullptr) return run();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return run();
  if (pid == 0) {
    const int rc = run();
    std::fflush(nullptr);
    _exit(rc);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  const int sig = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
  if (sig == SIGINT || sig == SIGTERM) return 128 + sig;
  if (sig == SIGPIPE) {  // the reader of the output went away (`inspect … | head -1`): no crash, exit as it would
    std::signal(SIGPIPE, SIG_DFL);
    std::raise(SIGPIPE);
    return 128 + sig;
  }
  std::cerr << "lockstep " << command << ": crashed (signal " << sig << ", " << strsignal(sig)
            << "); no result was produced. A trace damaged past what libhdf5 1.10 can read does this "
               "(docs/fuzzing.md; `lockstep inspect` shows what it holds); on an undamaged trace it is a "
               "lockstep bug: please report it with this command line\n";
  return 1;
}
