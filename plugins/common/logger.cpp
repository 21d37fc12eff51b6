// Logging glue (see logger.h) and the library's logging entry points: setLoggerFinder for
// IPluginRegistry::loadLibrary, attnx_plugins_errors / attnx_plugins_clear_errors for Python.
//
// Trap (TensorRT-RTX 1.7): its ILoggerFinder::findLogger always returns null, and its ILogger
// derives from IVersionedInterface (a different vtable from the TensorRT 10.x headers), so the
// logger is found through the loading library's own getLogger() and called through RtxLogger.
#include "common/logger.h"

#include "common/plugin_common.h"

#include <cstdio>
#include <cstring>
#include <deque>
#include <dlfcn.h>
#include <mutex>

namespace attnx
{
namespace plugin
{

// TensorRT-RTX's logger interface, as its Python bindings' vtables show: IVersionedInterface
// (getAPILanguage, getInterfaceInfo, destructors), then log. Only called after
// getInterfaceInfo() reports kind "ILogger". (Not in an anonymous namespace: GCC would see
// that nothing implements it and devirtualize the call into __cxa_pure_virtual.)
class RtxLogger : public nvinfer1::IVersionedInterface
{
public:
    virtual void log(nvinfer1::ILogger::Severity severity, char const* msg) noexcept = 0;

protected:
    ~RtxLogger() noexcept override = default;
};

namespace
{

// How to talk to the logger of the TensorRT library that loaded us.
enum class LoggerAbi
{
    kUnresolved,
    kHeader,    // TensorRT 10.x: ILogger as in the headers we compile against (log is the first virtual).
    kVersioned, // TensorRT-RTX 1.x: v_1_0::ILogger derives from IVersionedInterface (see RtxLogger).
    kNone,      // unknown library: stderr only
};

using GetLoggerFn = void* (*) ();
using GetMajorFn = int32_t (*)();

std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder{nullptr};
GetLoggerFn gGetLogger{nullptr};
LoggerAbi gAbi{LoggerAbi::kUnresolved};

constexpr size_t kMaxKeptErrors = 64;
std::mutex gErrorsMutex;
std::deque<std::string> gErrors;

// Which TensorRT handed us the finder: the library holding the finder's vtable. Its exported
// C functions getInferLibMajorVersion() and getLogger() are looked up there only (never by a
// global symbol search). TensorRT-RTX 1.7's ILoggerFinder::findLogger always returns null, so
// getLogger() (the logger of the current builder/runtime) is the fallback. Holds gLoggerMutex.
void resolveLoggerAbi()
{
    if (gAbi != LoggerAbi::kUnresolved)
    {
        return;
    }
    gAbi = LoggerAbi::kNone;
    if (gLoggerFinder == nullptr)
    {
        return;
    }
    Dl_info info{};
    void const* vtable = *reinterpret_cast<void const* const*>(gLoggerFinder);
    if (dladdr(vtable, &info) == 0 || info.dli_fname == nullptr)
    {
        return;
    }
    void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr)
    {
        return;
    }
    gGetLogger = reinterpret_cast<GetLoggerFn>(dlsym(handle, "getLogger"));
    auto const getMajor = reinterpret_cast<GetMajorFn>(dlsym(handle, "getInferLibMajorVersion"));
    std::string const path = info.dli_fname;
    if (path.find("tensorrt_rtx") != std::string::npos)
    {
        gAbi = LoggerAbi::kVersioned;
    }
    else if (getMajor != nullptr && getMajor() == NV_TENSORRT_MAJOR)
    {
        gAbi = LoggerAbi::kHeader;
    }
}

bool logThrough(void* logger, LoggerAbi abi, nvinfer1::ILogger::Severity severity, char const* msg)
{
    if (logger == nullptr)
    {
        return false;
    }
    if (abi == LoggerAbi::kHeader)
    {
        static_cast<nvinfer1::ILogger*>(logger)->log(severity, msg);
        return true;
    }
    if (abi == LoggerAbi::kVersioned)
    {
        auto* versioned = static_cast<RtxLogger*>(logger);
        nvinfer1::InterfaceInfo const iface = versioned->getInterfaceInfo();
        if (iface.kind != nullptr && std::strcmp(iface.kind, "ILogger") == 0)
        {
            versioned->log(severity, msg);
            return true;
        }
    }
    return false;
}

void keepError(std::string const& message)
{
    std::lock_guard<std::mutex> lock(gErrorsMutex);
    if (gErrors.size() >= kMaxKeptErrors)
    {
        gErrors.pop_front();
    }
    gErrors.push_back(message);
}

} // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    gLoggerFinder = finder;
    gGetLogger = nullptr;
    gAbi = LoggerAbi::kUnresolved;
}

void log(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept
{
    bool const isError = severity <= nvinfer1::ILogger::Severity::kERROR;
    bool logged{false};
    try
    {
        if (isError)
        {
            keepError(message);
        }
        void* logger{nullptr};
        LoggerAbi abi{LoggerAbi::kNone};
        {
            // Find the logger under the lock, call it outside (it may take the Python GIL).
            std::lock_guard<std::mutex> lock(gLoggerMutex);
            resolveLoggerAbi();
            abi = gAbi;
            if (abi != LoggerAbi::kNone)
            {
                logger = gLoggerFinder != nullptr ? static_cast<void*>(gLoggerFinder->findLogger()) : nullptr;
                if (logger == nullptr && gGetLogger != nullptr)
                {
                    logger = gGetLogger();
                }
            }
        }
        logged = logThrough(logger, abi, severity, message.c_str());
    }
    catch (...)
    {
        logged = false;
    }
    if (!logged && severity <= nvinfer1::ILogger::Severity::kWARNING)
    {
        std::fprintf(stderr, "[attnx plugins] %s\n", message.c_str());
    }
}

// The kept errors, newest last, one per line.
std::string keptErrors()
{
    std::string all;
    std::lock_guard<std::mutex> lock(gErrorsMutex);
    for (auto const& e : gErrors)
    {
        all += e;
        all += '\n';
    }
    return all;
}

void clearKeptErrors()
{
    std::lock_guard<std::mutex> lock(gErrorsMutex);
    gErrors.clear();
}

} // namespace plugin
} // namespace attnx

// ---------------------------------------------------------------------------------- library entry points

extern "C" ATTNX_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    attnx::plugin::setLoggerFinder(finder);
}

// The plugins' recent error messages (newest last, one per line), for callers whose TensorRT
// logger does not show them. Returns the full length; copies at most size-1 bytes plus NUL.
extern "C" ATTNX_PLUGIN_API size_t attnx_plugins_errors(char* buffer, size_t size)
{
    std::string const all = attnx::plugin::keptErrors();
    if (buffer != nullptr && size > 0)
    {
        size_t const n = all.size() < size - 1 ? all.size() : size - 1;
        std::memcpy(buffer, all.data(), n);
        buffer[n] = '\0';
    }
    return all.size();
}

extern "C" ATTNX_PLUGIN_API void attnx_plugins_clear_errors(void)
{
    attnx::plugin::clearKeptErrors();
}
