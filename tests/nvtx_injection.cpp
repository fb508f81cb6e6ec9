// A minimal NVTX tool for tests/test_nvtx_injection.py: what Nsight Systems receives,
// written to a file. Loaded by the NVTX headers compiled into any NVTX-using library
// (the `nvtx` Python package here) when NVTX_INJECTION64_PATH names this library.
//
// Handlers: domain create/destroy, registered strings, range push/pop and marks, both
// in named domains (the Ex calls the `nvtx` package makes) and in the default domain
// (ASCII and Ex). One line per event, tab-separated:
//   domain  <tid>  <domain>
//   push    <tid>  <domain>  <message>
//   pop     <tid>  <domain>
//   mark    <tid>  <domain>  <message>
// where <tid> is the OS thread id (gettid) and the default domain is written "-".
// The file is named by NVTX_RECORD_PATH.
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace {

struct Domain {
    std::string name;
};
struct String {
    std::string text;
};

std::mutex out_lock;
FILE* out = nullptr;

long thread_id() { return static_cast<long>(syscall(SYS_gettid)); }

const char* domain_name(nvtxDomainHandle_t domain) {
    return domain ? reinterpret_cast<Domain*>(domain)->name.c_str() : "-";
}

std::string message_of(const nvtxEventAttributes_t* attr) {
    if (attr == nullptr) return "";
    switch (attr->messageType) {
        case NVTX_MESSAGE_TYPE_ASCII:
            return attr->message.ascii ? attr->message.ascii : "";
        case NVTX_MESSAGE_TYPE_REGISTERED:
            return attr->message.registered ? reinterpret_cast<String*>(attr->message.registered)->text : "";
        case NVTX_MESSAGE_TYPE_UNICODE:
            return "<unicode>";
        default:
            return "";
    }
}

void write(const char* kind, nvtxDomainHandle_t domain, const std::string* message) {
    std::lock_guard<std::mutex> guard(out_lock);
    if (out == nullptr) return;
    if (message)
        std::fprintf(out, "%s\t%ld\t%s\t%s\n", kind, thread_id(), domain_name(domain), message->c_str());
    else
        std::fprintf(out, "%s\t%ld\t%s\n", kind, thread_id(), domain_name(domain));
    std::fflush(out);
}

// Named domains (NVTX_CB_MODULE_CORE2).
nvtxDomainHandle_t NVTX_API domain_create_a(const char* name) {
    auto* domain = new Domain{name ? name : ""};
    auto handle = reinterpret_cast<nvtxDomainHandle_t>(domain);
    write("domain", handle, nullptr);
    return handle;
}
void NVTX_API domain_destroy(nvtxDomainHandle_t) {}  // handles stay valid: later events may name them
nvtxStringHandle_t NVTX_API domain_register_string_a(nvtxDomainHandle_t, const char* text) {
    return reinterpret_cast<nvtxStringHandle_t>(new String{text ? text : ""});
}
int NVTX_API domain_range_push_ex(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* attr) {
    std::string message = message_of(attr);
    write("push", domain, &message);
    return 0;
}
int NVTX_API domain_range_pop(nvtxDomainHandle_t domain) {
    write("pop", domain, nullptr);
    return 0;
}
void NVTX_API domain_mark_ex(nvtxDomainHandle_t domain, const nvtxEventAttributes_t* attr) {
    std::string message = message_of(attr);
    write("mark", domain, &message);
}

// The default domain (NVTX_CB_MODULE_CORE).
int NVTX_API range_push_ex(const nvtxEventAttributes_t* attr) { return domain_range_push_ex(nullptr, attr); }
int NVTX_API range_push_a(const char* text) {
    std::string message = text ? text : "";
    write("push", nullptr, &message);
    return 0;
}
int NVTX_API range_pop() { return domain_range_pop(nullptr); }
void NVTX_API mark_ex(const nvtxEventAttributes_t* attr) { domain_mark_ex(nullptr, attr); }
void NVTX_API mark_a(const char* text) {
    std::string message = text ? text : "";
    write("mark", nullptr, &message);
}

bool set(NvtxGetExportTableFunc_t get_export_table, NvtxCallbackModule module, unsigned id, void* fn) {
    auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_export_table(NVTX_ETID_CALLBACKS));
    if (callbacks == nullptr) return false;
    NvtxFunctionTable table = nullptr;
    unsigned int size = 0;
    if (!callbacks->GetModuleFunctionTable(module, &table, &size) || table == nullptr || id >= size) return false;
    *table[id] = reinterpret_cast<NvtxFunctionPointer>(fn);
    return true;
}

}  // namespace

extern "C" NVTX_DYNAMIC_EXPORT int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
    const char* path = std::getenv("NVTX_RECORD_PATH");
    if (path == nullptr || (out = std::fopen(path, "w")) == nullptr) return 0;  // 0: NVTX stays off
    bool ok = true;
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainCreateA, (void*)domain_create_a);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainDestroy, (void*)domain_destroy);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRegisterStringA,
              (void*)domain_register_string_a);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePushEx, (void*)domain_range_push_ex);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainRangePop, (void*)domain_range_pop);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE2, NVTX_CBID_CORE2_DomainMarkEx, (void*)domain_mark_ex);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushEx, (void*)range_push_ex);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePushA, (void*)range_push_a);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_RangePop, (void*)range_pop);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_MarkEx, (void*)mark_ex);
    ok &= set(get_export_table, NVTX_CB_MODULE_CORE, NVTX_CBID_CORE_MarkA, (void*)mark_a);
    std::fprintf(out, "init\t%ld\t%s\n", thread_id(), ok ? "ok" : "incomplete");
    std::fflush(out);
    return ok ? 1 : 0;
}
