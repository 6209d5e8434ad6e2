// cli/import_cmd.cc — `lockstep import KIND …`: a trace from another engine's output. The
// importers are the Python package's (python/lockstep: `python3 -m lockstep import KIND`, which
// reads JSON and torch files with h5py and numpy); this command runs that package with the
// interpreter, the package folder and the zstd plugin of this build, so the documented
// `lockstep import …` works from a checkout without installing anything.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands.h"

namespace lockstep::cli {
namespace {

namespace fs = std::filesystem;

// The folder holding this executable (/proc/self/exe), empty when it cannot be read.
fs::path ExeDir() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : p.parent_path();
}

// Where the package is: $LOCKSTEP_PYTHON_DIR, else this build's source tree; empty when
// neither holds python/lockstep (an installed package is then found by the interpreter).
std::string PackageDir() {
  if (const char* e = std::getenv("LOCKSTEP_PYTHON_DIR"); e != nullptr && *e != '\0') return e;
  std::error_code ec;
  const fs::path built = LOCKSTEP_PYTHON_DIR;
  if (fs::is_regular_file(built / "lockstep" / "__init__.py", ec)) return built.string();
  return {};
}

Status RunImport(const std::vector<std::string>& args) {
  const char* py_env = std::getenv("LOCKSTEP_PYTHON");
  std::error_code ec;
  const std::string python = py_env != nullptr && *py_env != '\0'            ? py_env
                             : fs::is_regular_file(LOCKSTEP_PYTHON_DEFAULT, ec) ? LOCKSTEP_PYTHON_DEFAULT
                                                                             : "python3";
  // `python3 -m lockstep`, after one line instead of a traceback when the interpreter lacks what
  // the package needs.
  std::vector<std::string> argv = {
      python, "-c",
      "import sys, runpy\n"
      "try:\n"
      "    import numpy, h5py\n"
      "    import lockstep\n"
      "except ImportError as e:\n"
      "    sys.stderr.write('lockstep: import needs Python 3 with h5py and numpy (Debian: python3-h5py python3-numpy "
      "python3-xxhash) and the package python/lockstep: ' + sys.executable + ': ' + str(e) + ' (set LOCKSTEP_PYTHON or "
      "LOCKSTEP_PYTHON_DIR)\\n')\n"
      "    sys.exit(1)\n"
      "sys.argv[0] = 'lockstep'\n"
      "runpy.run_module('lockstep', run_name='__main__', alter_sys=True)\n"};
  const fs::path plugins = ExeDir() / "hdf5-plugins";
  if (!ExeDir().empty() && fs::is_directory(plugins, ec)) {
    argv.push_back("--plugin-path");
    argv.push_back(plugins.string());
  }
  argv.push_back("import");
  argv.insert(argv.end(), args.begin(), args.end());
  const std::string pkg = PackageDir();
  if (!pkg.empty()) {
    const char* old = std::getenv("PYTHONPATH");
    const std::string v = pkg + (old != nullptr && *old != '\0' ? std::string(":") + old : std::string());
    ::setenv("PYTHONPATH", v.c_str(), 1);
  }
  ::setenv("LOCKSTEP_PROG", "lockstep", 1);  // the importer's usage lines name this command
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return Status::Internal(std::string("import: fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::execvp(cargv[0], cargv.data());
    // Only reached when the interpreter cannot be run.
    const std::string msg = "lockstep: import needs Python 3 with h5py and numpy (Debian: python3-h5py "
                            "python3-numpy python3-xxhash); cannot run '" + python + "': " +
                            std::strerror(errno) + " (set LOCKSTEP_PYTHON)\n";
    (void)!::write(2, msg.data(), msg.size());
    ::_exit(1);
  }
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0) {
    if (errno != EINTR) return Status::Internal(std::string("import: waitpid: ") + std::strerror(errno));
  }
  if (WIFEXITED(st)) {
    // The importer printed its own one-line error; pass its exit status on (1 error, 2 usage).
    ExitCode() = WEXITSTATUS(st);
    return Status::Ok();
  }
  return Status::Internal("import: " + python + " ended by signal " + std::to_string(WTERMSIG(st)));
}

}  // namespace

void RegisterImport(CLI::App& app, SetAction set_action) {
  auto* sub = app.add_subcommand(
      "import", "Make a trace from another engine's output (the Python package's importers)");
  sub->footer(
      "KIND and its arguments go to `python3 -m lockstep import KIND …` (python/lockstep of this\n"
      "checkout, or an installed package; Debian: python3-h5py python3-numpy python3-xxhash):\n"
      "  openai FILE -m MODEL -o OUT.h5   completions with token ids and logprobs (vLLM, sglang,\n"
      "                                   lockstep serve; one response, an array or JSONL)\n"
      "  sglang DIR -m MODEL -o OUT.h5    sglang's tensor dumps (its debug dumper's .pt files)\n"
      "`lockstep import KIND --help` shows an importer's options. Then\n"
      "  lockstep replay OUT.h5 --mode forced   runs lockstep's reference on the same tokens and\n"
      "                                         compares every imported row (docs/python.md).\n"
      "Environment: LOCKSTEP_PYTHON (the interpreter, default " LOCKSTEP_PYTHON_DEFAULT " when it exists,\n"
      "else python3 on PATH), LOCKSTEP_PYTHON_DIR (the package folder, default " LOCKSTEP_PYTHON_DIR ").");
  sub->prefix_command();
  sub->callback([sub, set_action] {
    std::vector<std::string> rest = sub->remaining();
    set_action([rest] {
      if (rest.empty()) {
        return Status::InvalidArgument("import: name what to import: openai FILE or sglang DIR (lockstep import --help)");
      }
      return RunImport(rest);
    });
  });
}

}  // namespace lockstep::cli
